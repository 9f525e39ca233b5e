"""Discrete-event simulation of dynbatchd on simulated accelerators (every figure SIMULATED).

The daemon's own engine (`dynbatchd.engine`) runs against a virtual clock in
integer nanoseconds, and every arrival passes the daemon's own intake
(`dynbatchd.engine.intake`: routing, tenancy, compliance, cache key, deadline
default), so the two answer alike (tests/engine/test_intake.py); the sockets and
the workers are replaced. What it leaves out (quotas, CURVE keys, faults, a
reload mid-run) docs/simulator.md lists.

- `devices`: the latency model shared with the live `simulated` runner;
- `traces`: arrivals, the trace CSV reader and the guide's token mix;
- `driver`: the event loop that feeds the engine (`simulate()`);
- `results`: what a run did, and the figures reports show;
- `configured`: a run wired from a config and its plugins (`run_config`), and the
  config's simulated device (`config_device`).
"""

from dynbatchd.simulate.devices import DeviceModel, VirtualRunner
from dynbatchd.simulate.driver import SimulationError, rules_router, simulate
from dynbatchd.simulate.configured import config_device, run_config, simulated_model_options
from dynbatchd.simulate.results import (COMPLETED, EXPIRED, FAILED, MS, OUTCOME_NAMES, OVERLOADED, PENDING,
                                        BatchRecord, GroupStats, SimResult, quantile)
from dynbatchd.simulate.traces import GUIDE_MIX, Arrival, as_arrival, mix_tokens, poisson, poisson_times, read_trace_csv

__all__ = ["Arrival", "BatchRecord", "COMPLETED", "DeviceModel", "EXPIRED", "FAILED", "GUIDE_MIX", "GroupStats",
           "MS", "OUTCOME_NAMES", "OVERLOADED", "PENDING", "SimResult", "SimulationError", "VirtualRunner",
           "as_arrival", "config_device", "run_config", "simulated_model_options", "mix_tokens", "poisson", "poisson_times", "quantile", "read_trace_csv", "rules_router", "simulate"]
