"""How late batches end past their plan, and plans that aim that much before each deadline
(`Channel.batch_ended`, `Channel.end_slip_ns`), against a fake clock.

A live daemon's batches end a little after the learned cost says (the hand-over to the device
and back, the cost's own error); a plan that fills batches to the edge of their deadlines then
answers some a few ms late. The simulator's cost is exact: there the slip stays 0.
"""

from __future__ import annotations

import itertools

from dynbatchd.config import ChannelSettings
from dynbatchd.scheduler import MS, Item, Scheduler, build_channels
from dynbatchd.scheduler.lanes import Batch

_keys = itertools.count(1)
SECOND = 1000 * MS


def item(at_ms: float, tokens: int, deadline_ms: float) -> Item:
    at = int(at_ms * MS)
    return Item(next(_keys), "m", at, at + int(deadline_ms * MS), tokens, None, None, "c")


def device_ms(size: int, tokens: int) -> float:
    """The device: 8 ms + 0.5 ms a request + 0.002 ms a token."""
    return 8 + 0.5 * size + 0.002 * tokens


def taught(deadline_ms: float = 1000) -> Scheduler:
    s = Scheduler(build_channels({"c": ChannelSettings(max_batch=2, window_ms=0, deadline_ms=deadline_ms)}))
    for size, tokens in [(1, 100), (4, 2000), (8, 500), (2, 9000), (16, 4000)] * 5:
        s.channels["c"].cost.observe(size, tokens, int(device_ms(size, tokens) * MS), 0)
    return s


def run_batches(s: Scheduler, count: int, late_ms: float, start_ms: float = 0) -> float:
    """Run `count` batches of one request, each ending `late_ms` past its plan; the clock after."""
    now = start_ms
    for _ in range(count):
        assert s.submit(item(now, 300, 1000), int(now * MS))
        [batch] = s.poll(int(now * MS), free_slots=1).batches
        assert batch.planned_end_ns == int(now * MS) + s.channels["c"].cost.estimate_ns(1, 300)
        now += device_ms(1, 300) + late_ms
        s.completed(batch, int(device_ms(1, 300) * MS), int(now * MS))
    return now


def test_a_channel_learns_how_late_its_batches_end_past_their_plan():
    s = taught()
    assert s.channels["c"].end_slip_ns == 0
    now = run_batches(s, 20, late_ms=3)
    assert abs(s.channels["c"].end_slip_ns - 3 * MS) < 0.01 * MS
    assert s.channels["c"].snapshot(int(now * MS))["end_slip_ms"] == s.channels["c"].end_slip_ns / 1e6


def test_batches_that_end_early_leave_no_slip():
    s = taught()
    run_batches(s, 20, late_ms=-2)
    assert s.channels["c"].end_slip_ns == 0


def test_a_stall_moves_the_slip_no_further_than_a_twentieth_of_the_deadline():
    s = taught(deadline_ms=1000)
    run_batches(s, 20, late_ms=400)
    assert s.channels["c"].end_slip_ns == 50 * MS


def test_the_slip_reads_the_recent_batches_only():
    s = taught()
    now = run_batches(s, 20, late_ms=3)
    run_batches(s, s.channels["c"].SLIP_BATCHES, late_ms=0, start_ms=now)
    assert abs(s.channels["c"].end_slip_ns) < 0.01 * MS


def test_a_plan_aims_the_slip_before_the_deadline():
    # a (300 tokens, due at 11 ms) and b (400 tokens, due at 40 ms): together 10.4 ms, a alone 9.1.
    # With no slip both run at once; once batches end 1 ms past their plan, a's batch must end by
    # 10 ms, so the plan drops the largest (b) and a runs alone.
    def first_batch(late_ms: float) -> list[int]:
        s = taught()
        now = run_batches(s, 20, late_ms=late_ms)
        a, b = item(now, 300, 11), item(now, 400, 40)
        for it in (a, b):
            assert s.channels["c"].offer(it, int(now * MS))
        [batch] = s.poll(int(now * MS), free_slots=1).batches
        return [it.tokens for it in batch.items]
    assert first_batch(late_ms=0) == [300, 400]
    assert first_batch(late_ms=1) == [300]


def test_a_window_closes_the_slip_earlier():
    # A 100 ms window on a busy device; the one request queued is due 50 ms after it came: the
    # window closes when a batch of it would end just in time, `end_slip_ns` sooner once learned.
    def ready_after_ms(late_ms: float) -> float:
        s = Scheduler(build_channels({"c": ChannelSettings(max_batch=2, window_ms=100)}))
        for size, tokens in [(1, 100), (4, 2000), (8, 500), (2, 9000), (16, 4000)] * 5:
            s.channels["c"].cost.observe(size, tokens, int(device_ms(size, tokens) * MS), 0)
        channel = s.channels["c"]
        for k in range(10):   # ten batches, each planned to end at 1 s + k ms, ending `late_ms` after
            planned = SECOND + k * MS
            channel.batch_ended(Batch(k, "c", "m", [], 0, 2, 0, planned), planned + int(late_ms * MS))
        it = item(0, 300, 50)
        assert channel.offer(it, 0)
        [lane] = channel.lanes.values()
        return channel.ready_at(lane, 0, free_slots=1, draining=False, busy_ns=5 * MS) / MS
    assert abs(ready_after_ms(0) - (50 - device_ms(1, 300))) < 0.01
    assert abs(ready_after_ms(3) - (50 - device_ms(1, 300) - 3)) < 0.01
