"""Which requests form a batch (issue 7, the x80 trace replay), against a fake clock.

Each test pins one rule of `Channel.form` / `LongShare` that the replay measured:
see docs/benchmarks.md, "Bursty, mixed-size traffic".
"""

from __future__ import annotations

import itertools

from dynbatchd.config import ChannelSettings
from dynbatchd.scheduler import MS, Item, Scheduler, build_channels
from dynbatchd.scheduler.longshare import LongShare

_keys = itertools.count(1)


def item(at_ms: float, tokens: int, deadline_ms: float = 1000) -> Item:
    at = int(at_ms * MS)
    return Item(next(_keys), "m", at, at + int(deadline_ms * MS), tokens, None, None, "c")


def scheduler(max_batch: int) -> Scheduler:
    s = Scheduler(build_channels({"c": ChannelSettings(max_batch=max_batch, window_ms=0)}))
    cost = s.channels["c"].cost          # taught a device of 8 ms + 0.5 ms/item + 0.002 ms/token
    for size, tokens in [(1, 100), (4, 2000), (8, 500), (2, 9000), (16, 4000)] * 5:
        cost.observe(size, tokens, int((8 + 0.5 * size + 0.002 * tokens) * MS))
    return s


def test_a_request_that_would_make_a_member_late_waits_even_when_one_batch_takes_everything():
    s = scheduler(max_batch=4)
    urgent, long = item(0, 100, deadline_ms=20), item(0, 10_000)
    for it in (urgent, long):
        assert s.submit(it, 0)
    # Both fit one batch, but together they run ~29 ms: the urgent one would end past its 20 ms.
    [first] = s.poll(0, free_slots=1).batches
    assert first.items == [urgent]
    [second] = s.poll(10 * MS, free_slots=1).batches
    assert second.items == [long]


def test_long_requests_owed_their_floor_are_dropped_from_the_plan_last():
    # Everything is due at 30 ms; batches take 8 ms + 0.5 ms a request + 0.002 ms a token. Unowed, the
    # plan drops the largest requests (9,000 then 2,000 tokens) and runs the two short ones. Owed, it
    # drops the short ones first (120, then 100), then the largest long one (9,000: with 2,000 it would
    # end at 31 ms), and runs the long request of 2,000 tokens.
    def plan(owed: bool) -> list[int]:
        s = scheduler(max_batch=2)
        for it in [item(0, t, deadline_ms=30) for t in (100, 9000, 120, 2000)]:
            assert s.submit(it, 0)
        ledger = s.channels["c"].long_share
        ledger.cut, ledger.asked, ledger.got = 1000.0, [1.0, 1.0], [1.0, 0.0 if owed else 1.0]
        assert ledger.owed() == owed
        [batch] = s.poll(0, free_slots=1).batches
        return [it.tokens for it in batch.items]
    assert plan(owed=False) == [100, 120]
    assert plan(owed=True) == [2000]


def _ledger_after_a_burst(burst: int) -> LongShare:
    """2,000 requests all served (a tenth long), then `burst` more of which only the short ones run."""
    ledger = LongShare()
    cost = {100: 0.7e6, 5000: 10.5e6}
    for i in range(2000 + burst):
        tokens = 5000 if i % 10 == 5 else 100
        ledger.arrived(tokens, cost[tokens])
        if i < 2000 or tokens == 100:
            ledger.served([tokens], [cost[tokens]])
    return ledger


def test_a_burst_does_not_owe_long_requests_device_time_they_had_seconds_before():
    assert not _ledger_after_a_burst(3000).owed()   # with a memory of ~1,000 requests it was owed here
    assert _ledger_after_a_burst(9000).owed()       # but a long starvation still is
