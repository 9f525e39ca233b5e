"""Analyzer: a latency/throughput model of one channel, fitted to what the collector observed.

The model is the simulator on the learned batch cost (`DeviceModel`) fed Poisson traffic at
the observed rate and request size. Its fit error is how far the model's on-time share and p99
for the *running* settings land from what the daemon measured: a large error means the
recommendation rests on a poor model, and the report says so."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from dynbatchd.simulate import Arrival, DeviceModel, SimResult, poisson, simulate
from dynbatchd.tuning.collector import Observation

SECOND = 1_000_000_000
MAX_ARRIVALS = 20_000   # per simulated run, so one trial stays well under a second


@dataclass(frozen=True, slots=True)
class ChannelModel:
    """What a trial replays: the channel's traffic and its devices (every figure SIMULATED)."""
    channel: str
    device: DeviceModel
    devices: int
    rate_rps: float
    mean_tokens: float
    duration_s: float
    seed: int = 1

    def traffic(self, scale: float = 1.0) -> list[Arrival]:
        """Poisson arrivals at `scale` x the observed rate, all to the channel (deterministic)."""
        rng = random.Random(self.seed)
        rate = self.rate_rps * scale
        duration = min(self.duration_s, MAX_ARRIVALS / rate)
        tokens = round(self.mean_tokens)
        return [Arrival(int(t * SECOND), tokens, self.channel) for t in poisson(rng, rate, 0.0, duration)]

    def run(self, channels: dict[str, Any], arrivals: list[Arrival], **kw: Any) -> SimResult:
        return simulate(channels, arrivals, device=self.device, devices=self.devices, **kw)


def fit(observation: Observation, duration_s: float = 20.0, seed: int = 1) -> ChannelModel:
    """The model of a channel from its observations."""
    device = DeviceModel(observation.cost_base_ms, observation.cost_per_item_ms, observation.cost_per_token_ms)
    return ChannelModel(observation.channel, device, observation.devices, observation.arrival_rps,
                        observation.mean_tokens, duration_s, seed)


def fit_error(observation: Observation, on_time: float, p99_ms: float) -> dict[str, float]:
    """How far the model's on-time share and p99 for the running settings are from the measured ones."""
    p99 = p99_ms
    return {"on_time_error": round(abs(on_time - observation.on_time), 4),
            "p99_error_ms": round(abs(p99 - observation.p99_ms), 3),
            "p99_relative_error": round(abs(p99 - observation.p99_ms) / observation.p99_ms, 4)
            if observation.p99_ms > 0 else 0.0}


def cells_error(model: ChannelModel, cells: list[dict[str, Any]], run_setting: Any, limit: int = 5
                ) -> dict[str, Any] | None:
    """The model against `bench` cells measured live on this channel at an open-loop rate: each
    cell is replayed at its rate and setting (`run_setting(max_batch, window_ms, policy, rate)`
    returns the predicted (on-time share, p99 ms)), and the mean absolute errors reported.
    None when there is no such cell (closed-loop and simulated cells say nothing of the device)."""
    usable = [c for c in cells if c.get("channel") == model.channel and not c.get("simulated")
              and c.get("load_kind") == "open" and c.get("load", 0) > 0 and c.get("on_time") is not None][:limit]
    if not usable:
        return None
    on_time_err, p99_err = [], []
    for c in usable:
        on_time, p99 = run_setting(int(c["max_batch"]), float(c["window_ms"]), c.get("policy") or "fixed",
                                   float(c["load"]))
        on_time_err.append(abs(on_time - c["on_time"]))
        if c.get("p99_ms"):
            p99_err.append(abs(p99 - c["p99_ms"]) / c["p99_ms"])
    return {"cells": len(usable), "on_time_error": round(sum(on_time_err) / len(on_time_err), 4),
            "p99_relative_error": round(sum(p99_err) / len(p99_err), 4) if p99_err else None}
