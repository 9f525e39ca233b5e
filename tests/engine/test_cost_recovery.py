"""A learned cost that goes wrong cannot lock a channel: it recovers within seconds.

Against a fake clock, a scheduler fed requests and one fake device that really takes
17 ms a batch; before, its cost model was taught something far slower (slow first batches,
outliers). Then live: a callable model slow only for its first batches.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dynbatchd.config import ChannelSettings
from dynbatchd.scheduler import MS, CostModel, Item, Scheduler, build_channels

SECOND = 1000 * MS
_keys = itertools.count(1)


@dataclass
class Run:
    expired: list[int] = field(default_factory=list)     # when each expiry was answered (ns)
    completed: list[int] = field(default_factory=list)   # when each request was answered
    overloaded: int = 0


def serve(s: Scheduler, channel: str, *, start_ns: int, seconds: float, every_ms: int, deadline_ms: float,
          compute_ms: float = 17.0) -> Run:
    """One device, one batch at a time, taking `compute_ms` a batch; a request every `every_ms`."""
    run, running = Run(), None
    for ms in range(int(seconds * 1000)):
        now = start_ns + ms * MS
        if running is not None and running[1] <= now:
            s.completed(running[0], int(compute_ms * MS), now)
            run.completed += [now] * len(running[0].items)
            running = None
        if ms % every_ms == 0:
            request = Item(next(_keys), "m", now, now + int(deadline_ms * MS), 16, None, None, channel)
            if not s.submit(request, now, 1, idle=running is None):
                run.overloaded += 1
        decision = s.poll(now, free_slots=0 if running else 1)
        run.expired += [now] * len(decision.expired)
        if decision.batches:
            running = (decision.batches[0], now + int(compute_ms * MS))
    return run


def standard() -> Scheduler:
    return Scheduler(build_channels({"standard": ChannelSettings(max_batch=32, window_ms=10, deadline_ms=500)}))


def test_slow_first_batches_do_not_lock_the_channel():
    # The shipped config under 40 req/s: the first three batches (1, 4, 5) took 3 s in all.
    s = standard()
    for n, ms in ((1, 1000), (4, 900), (5, 1100)):
        s.completed(_batch(s, "standard", n), ms * MS, 3 * SECOND)
    run = serve(s, "standard", start_ns=3 * SECOND, seconds=5, every_ms=25, deadline_ms=500)
    assert not run.expired and not run.overloaded
    assert len(run.completed) >= 195


def test_a_settled_cost_far_too_slow_is_probed_while_the_device_idles_and_recovers_within_a_second():
    # 20 batches timed at 2 s each (settled, just confirmed): every request looks hopeless at once.
    s = standard()
    for _ in range(CostModel.SETTLED_AFTER):
        s.completed(_batch(s, "standard", 1), 2 * SECOND, 0)
    run = serve(s, "standard", start_ns=0, seconds=5, every_ms=25, deadline_ms=500)
    assert run.completed, "no request ever ran: the channel is locked"
    assert max(run.expired, default=0) < 1 * SECOND     # recovered within a second
    assert len(run.completed) >= 150
    assert s.channels["standard"].cost.estimate_ns(1, 16) < 20 * MS


def test_a_cost_never_refuses_work_once_no_batch_has_confirmed_it_for_a_while():
    # No device is free to probe; the settled cost says 2 s. Refused at first, but after
    # CONFIRMED_FOR_NS without a measured batch, nothing is refused on that cost any more.
    s = standard()
    for _ in range(CostModel.SETTLED_AFTER):
        s.completed(_batch(s, "standard", 1), 2 * SECOND, 0)
    early = Item(next(_keys), "m", MS, MS + 500 * MS, 16, None, None, "standard")
    assert s.submit(early, MS, 1, idle=False)
    assert s.poll(2 * MS, free_slots=0).expired == [early]
    later_ns = CostModel.CONFIRMED_FOR_NS + 2 * MS
    late = Item(next(_keys), "m", later_ns, later_ns + 500 * MS, 16, None, None, "standard")
    assert s.submit(late, later_ns, 1, idle=False)
    assert s.poll(later_ns + MS, free_slots=0).expired == []
    assert s.next_wakeup(later_ns + MS, free_slots=0) == late.deadline_ns + 1   # (no busy wake-ups meanwhile)


def test_the_realtime_channel_after_one_slow_batch_still_runs_its_requests():
    s = Scheduler(build_channels({"realtime": ChannelSettings(max_batch=8, window_ms=2, deadline_ms=200)}))
    s.completed(_batch(s, "realtime", 1), 9 * MS, 0)
    s.completed(_batch(s, "realtime", 1), 398 * MS, 0)
    run = serve(s, "realtime", start_ns=SECOND, seconds=2, every_ms=100, deadline_ms=200, compute_ms=9)
    assert not run.expired and len(run.completed) == 20


def test_a_disputed_cost_refuses_nothing_and_says_so_once(caplog):
    s = standard()
    channel = s.channels["standard"]
    for ms in [40] * 20 + [9, 9, 13, 9, 9]:   # the fit still says 40 ms; the last batches took ~9
        s.completed(_batch(s, "standard", 1), ms * MS, 0)
    assert channel.cost.disputed
    caplog.set_level(logging.WARNING, logger="dynbatchd.scheduler")
    queued = []
    for i in range(3):   # each would end past its 30 ms deadline by the disputed cost, behind a busy device
        request = Item(next(_keys), "m", MS, MS + 30 * MS, 0, None, None, "standard")
        assert s.submit(request, MS, 1, idle=False)
        queued.append(request)
    decision = s.poll(2 * MS, free_slots=0, device_busy_ns=5 * MS)
    assert decision.expired == []
    assert channel.stats.cost_disputed == 3 and channel.snapshot(0)["cost_disputed"] == 3
    lines = [r.getMessage() for r in caplog.records if "learned cost" in r.getMessage()]
    assert len(lines) == 1 and "standard" in lines[0]


def _batch(s: Scheduler, channel: str, size: int):
    """A batch of `size` cut from `channel` (queued and polled at time 0 with a long deadline)."""
    for _ in range(size):
        assert s.channels[channel].offer(Item(next(_keys), "m", 0, 100 * SECOND, 16, None, None, channel), 0)
    s.drain()
    (batch,) = s.poll(0, free_slots=1).batches
    s.draining = False
    return batch


# -- live ---------------------------------------------------------------------------------------

def test_live_a_model_slow_only_for_its_first_batches_is_served_once_it_is_fast(tmp_path: Path):
    """A callable that takes 1.5 s for each of its first two batches, then no time: before, the
    cost learned from those two expired every later request (deadline 1 s) for good."""
    from conftest import start_daemon
    from dynbatchd.client import Client, DeadlineExceeded

    daemon = start_daemon(tmp_path, """
        [models.slowstart]
        runner = "callable"
        options = { target = "slow_start:slow_first_batches" }
        [channels.standard]
        max_batch = 8
        window_ms = 1
        deadline_ms = 1000
    """)
    try:
        with Client(daemon.endpoint, timeout=30) as client:
            for text in ("a", "b"):   # the two slow batches (each late, or expired while the first ran)
                try:
                    client.infer("slowstart", text)
                except DeadlineExceeded:
                    pass
            answers = [client.infer("slowstart", f"text {i}") for i in range(20)]
        assert answers == [f"text {i}" for i in range(20)]
    finally:
        daemon.stop()
