"""Once a second: what the devices are doing, for the batch sizers, and who is hung.

Utilisation and memory use come from NVML on GPUs; on the CPU, utilisation
is the worker's measured busy fraction and memory is not reported (0). The
same beat replaces a worker that has held a batch too long (hung in a model,
or answering with messages the daemon cannot read).
"""

from __future__ import annotations

import asyncio
from typing import Callable

from dynbatchd.devices.pool import DevicePool
from dynbatchd.engine import Engine
from dynbatchd.telemetry import NvmlProbe


async def observe_devices(engine: Engine, pool: DevicePool, clock: Callable[[], int], after: Callable[[], None],
                          hung_after_s: float, every_s: float = 1.0) -> None:
    """Forever: every `every_s`, replace workers stuck on a batch for `hung_after_s`, tell the
    engine (utilisation, memory), then `after()`."""
    probe = NvmlProbe()
    last = [(d.stats.busy_ns, clock()) for d in engine.devices]
    while True:
        await asyncio.sleep(every_s)
        now = clock()
        if hung_after_s > 0:
            for index in engine.overdue(now, int(hung_after_s * 1e9)):
                pool.kill(index, f"has held a batch for more than {hung_after_s:g} s")
        utils, mems = [], []
        for i, device in enumerate(engine.devices):
            busy0, t0 = last[i]
            last[i] = (device.stats.busy_ns, now)
            reading = probe.read(device.name)
            if reading is not None:
                utils.append(reading[0])
                mems.append(reading[1])
            elif now > t0:
                utils.append(min(1.0, (device.stats.busy_ns - busy0) / (now - t0)))
        engine.memory_used = max(mems) if mems else 0.0
        engine.observe(now, sum(utils) / len(utils) if utils else 0.0, engine.memory_used)
        after()
