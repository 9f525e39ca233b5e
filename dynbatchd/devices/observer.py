"""Feed batch-size policies what the devices are doing, once a second.

Utilisation and memory use come from NVML on GPUs; on the CPU, utilisation
is the worker's measured busy fraction and memory is not reported (0). The
same beat replaces a worker that has held a batch too long (hung in a model,
or answering with messages the daemon cannot read).
"""

from __future__ import annotations

import asyncio
from typing import Callable

from dynbatchd.devices.pool import DevicePool
from dynbatchd.scheduler import Channel
from dynbatchd.telemetry import NvmlProbe

LATENCY_PERIOD_S = 30.0


async def observe_devices(pool: DevicePool, channels: dict[str, Channel], clock: Callable[[], int],
                          after: Callable[[], None], hung_after_s: float, every_s: float = 1.0) -> None:
    """Forever: every `every_s`, replace workers stuck on a batch for `hung_after_s`, tell each
    channel's sizer (utilisation, memory, queue length), then `after()`."""
    probe = NvmlProbe()
    last = {w.name: (w.stats.busy_ns, clock()) for w in pool.workers.values()}
    beats = 0
    while True:
        await asyncio.sleep(every_s)
        now = clock()
        beats += 1
        if beats % round(LATENCY_PERIOD_S / every_s) == 0:   # status shows the last 30-60 s of latency
            for channel in channels.values():
                channel.stats.latency.rotate()
        if hung_after_s > 0:
            pool.replace_hung(now, int(hung_after_s * 1e9))
        utils, mems = [], []
        for worker in pool.workers.values():
            busy0, t0 = last.get(worker.name, (worker.stats.busy_ns, now))
            last[worker.name] = (worker.stats.busy_ns, now)
            reading = probe.read(worker.device)
            if reading is not None:
                utils.append(reading[0])
                mems.append(reading[1])
            elif now > t0:
                utils.append(min(1.0, (worker.stats.busy_ns - busy0) / (now - t0)))
        util = sum(utils) / len(utils) if utils else 0.0
        mem = pool.memory_used = max(mems) if mems else 0.0
        for channel in channels.values():
            channel.sizer.observe(utilisation=util, memory=mem, queue_len=channel.depth, now_ns=now)
        after()
