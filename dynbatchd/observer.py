"""Once a second: what the devices are doing, for the batch sizers, and who is hung.

Utilisation comes from NVML on GPUs; on the CPU, it is the worker's measured
busy fraction. The memory the batch sizers see is what the daemon's own
batches need: the sum of each feeder's torch peak *allocated* bytes in its
last batch over the device's total (`dynbatchd.memory.batch_memory_fraction`),
not NVML's "used", which counts the weights, torch's allocator cache and
other processes and does not fall when batches shrink (a sizer fed it shrank
for ever). Only where no worker reports that figure (a GPU runner without
torch) is NVML's fraction used; on the CPU memory is not reported (0). The
health score's memory headroom stays NVML's (the whole device). The
same beat replaces a worker (the one feeder of its device that holds the
batch, not its siblings) that has held a batch too long (hung in a model,
or answering with messages the daemon cannot read): `batch_timeout_s`, or
less for a request rerun alone after its batch hung or died (`Engine.overdue`).

The last NVML reading of each GPU (utilisation, memory used and total, power)
is kept in `gpu_readings()`, by device name ("cuda:0"), for `/metrics`; a device
NVML does not answer for (the CPU, a GPU without a driver) has none there.
A daemon-side adapter (it tells the engine), so it sits beside the daemon, not in `dynbatchd.devices`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from dynbatchd.devices.pool import DevicePool
from dynbatchd.engine import Engine
from dynbatchd.memory import batch_memory_fraction
from dynbatchd.telemetry import NvmlProbe

log = logging.getLogger("dynbatchd.observer")

# device name -> its latest NVML reading. One daemon per process: the devices it observes.
_latest: dict[str, NvmlProbe.Reading] = {}


def gpu_readings() -> dict[str, NvmlProbe.Reading]:
    """The latest NVML reading of each device NVML answered for at the last beat (a copy)."""
    return dict(_latest)


def sample_devices(engine: Engine, probe: NvmlProbe, last: list[tuple[int, int]], now: int) -> None:
    """One beat's readings: keep each GPU's NVML figures, and tell the engine the mean
    utilisation (NVML's, else the worker's busy fraction since the last beat) and the fullest
    device's memory use. `last` holds each device's (busy_ns, time) at the previous beat."""
    utils, mems, sized = [], [], []
    for i, device in enumerate(engine.device_usage()):
        busy0, t0 = last[i]
        last[i] = (device.busy_ns, now)
        reading = probe.sample(device.name)
        if reading is None:
            _latest.pop(device.name, None)
        else:
            _latest[device.name] = reading
        if reading is not None and reading.memory_fraction is not None:
            mems.append(reading.memory_fraction)
            batches = batch_memory_fraction(device.batch_memory, reading.memory_total_bytes)
            sized.append(reading.memory_fraction if batches is None else batches)
        if reading is not None and reading.utilisation is not None:
            utils.append(reading.utilisation)
        elif now > t0:
            utils.append(min(1.0, (device.busy_ns - busy0) / (now - t0)))
    engine.observe(now, sum(utils) / len(utils) if utils else 0.0, max(sized) if sized else 0.0,
                   memory_used=max(mems) if mems else 0.0)


def _beat(engine: Engine, pool: DevicePool, probe: NvmlProbe, last: list, now: int, hung_after_s: float,
          after: Callable[[], None]) -> None:
    """One beat: replace the hung workers first (so nothing after them can keep them), then sample."""
    if hung_after_s > 0:
        for index, feeder, limit_ns in engine.overdue(now, int(hung_after_s * 1e9)):
            worker = index * engine.feeders + feeder   # (the pool's numbering)
            pool.kill(worker, f"has held a batch for more than {limit_ns / 1e9:g} s")
    sample_devices(engine, probe, last, now)
    after()


async def observe_devices(engine: Engine, pool: DevicePool, clock: Callable[[], int], after: Callable[[], None],
                          hung_after_s: float, every_s: float = 1.0, probe: NvmlProbe | None = None) -> None:
    """Forever: every `every_s`, replace workers stuck on a batch for `hung_after_s`, tell the
    engine (utilisation, memory), then `after()`."""
    probe = probe if probe is not None else NvmlProbe()
    last = [(d.busy_ns, clock()) for d in engine.device_usage()]
    failed: set[str] = set()   # kinds of failure already logged (each once: the beat comes every second)
    try:
        while True:
            await asyncio.sleep(every_s)
            try:
                _beat(engine, pool, probe, last, clock(), hung_after_s, after)
            except Exception as exc:   # a beat that raises must not end the watchdog: the next one still kills
                if type(exc).__name__ not in failed:
                    failed.add(type(exc).__name__)
                    log.error("device observer: a beat failed (%s: %s); it carries on", type(exc).__name__, exc)
    finally:
        for device in engine.device_usage():   # stopped: no reading is current any more
            _latest.pop(device.name, None)
