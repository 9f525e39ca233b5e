"""A simulation wired from a config and its plugins, as the daemon would run it: the one recipe.

`dynbatchctl simulate`, `recommend`, `bench --simulated` and the benchmarks used to wire
`simulate()` by hand (channels, routing, the devices' in-flight depth and queue lead, the
plugins' window policies and batch sizers), each a little differently. `run_config` is that
wiring; `config_device` is "the simulated device of this config".
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from dynbatchd.config import table_of
from dynbatchd.devices.latency import DeviceModel
from dynbatchd.devices.simulated_runner import simulated_options
from dynbatchd.simulate.driver import simulate
from dynbatchd.simulate.results import SimResult


def simulated_model_options(config: Any, model: str | None = None) -> dict[str, Any]:
    """The options of `model` when it is a ``simulated`` model, else of the config's first
    simulated model, else none (the simulator's default device)."""
    chosen = config.models.get(model) if model is not None else None
    if chosen is None or chosen.runner != "simulated":
        chosen = next((m for m in config.models.values() if m.runner == "simulated"), None)
    return dict(chosen.options) if chosen is not None else {}


def config_device(config: Any, model: str | None = None, device: str | None = None,
                  **overrides: float) -> DeviceModel:
    """The simulated device of this config (`simulated_model_options`): on `device`, that
    device's entry of the model's ``devices`` table over the rest; `overrides` (base_ms,
    per_item_ms, per_token_ms) over both."""
    options = simulated_model_options(config, model)
    if device is not None:
        options = simulated_options(options, device)
    return DeviceModel.from_options({**options, **overrides})


def run_config(config: Any, plugins: Any, traffic: Iterable[Any],
               devices: DeviceModel | Sequence[DeviceModel] | None = None, **simulate_kw: Any) -> SimResult:
    """Run `traffic` (arrivals) through the config's channels and routing on `devices` (a
    DeviceModel, one per device, or None: one `config_device`), with the config's in-flight
    depth and queue lead and the window policies, batch sizers and routing hook of `plugins`
    (None: the built-ins only). `simulate_kw` goes to `simulate()` over these."""
    kw: dict[str, Any] = dict(device=devices if devices is not None else config_device(config),
                              inflight=config.devices.inflight, queue_lead_ms=config.devices.queue_lead_ms,
                              routing=table_of(config, "routing"))   # default and the routing plugin's rules
    if plugins is not None:
        kw.update(window_policies=plugins.window_policies(), sizers=plugins.batch_sizers(), plugins=plugins)
    kw.update(simulate_kw)
    return simulate(config.channels, traffic, **kw)
