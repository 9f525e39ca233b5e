"""The device observer's beat (dynbatchd.observer): a beat that raises must not end the watchdog.

An adaptive sizer given `grow = inf` once raised inside the beat (in `Engine.observe`); the task
died without a word, and no hung worker was killed after it. Driven on a real event loop with no
pause between beats (`every_s=0`), and stopped once three beats have run."""

from __future__ import annotations

import asyncio
import logging

from dynbatchd import observer


class FailingEngine:
    """One device-less engine with a worker hung at every beat, whose sizers raise."""
    feeders = 1

    def device_usage(self):
        return []

    def overdue(self, now, limit_ns):
        return [(0, 0, limit_ns)]

    def observe(self, now, utilisation, memory, memory_used=0.0):
        raise OverflowError("cannot convert float infinity to integer")


class Pool:
    def __init__(self):
        self.killed: list[int] = []

    def kill(self, worker, why):
        self.killed.append(worker)


def test_a_beat_that_raises_is_logged_once_and_later_beats_still_kill_hung_workers(caplog):
    pool = Pool()

    async def three_beats():
        task = asyncio.ensure_future(observer.observe_devices(FailingEngine(), pool, lambda: 0, lambda: None,
                                                              hung_after_s=20, every_s=0, probe=object()))
        for _ in range(1000):   # (each turn of the loop lets the observer run one beat)
            if len(pool.killed) >= 3 or task.done():
                break
            await asyncio.sleep(0)
        alive = not task.done()
        task.cancel()
        return alive

    with caplog.at_level(logging.ERROR, logger="dynbatchd.observer"):
        assert asyncio.run(three_beats()), "the observer stopped at the first beat that raised"
    assert pool.killed[:3] == [0, 0, 0]
    errors = [r for r in caplog.records if r.name == "dynbatchd.observer"]
    assert len(errors) == 1 and "OverflowError" in errors[0].getMessage()
