"""Which requests form a batch (issue 7, the x80 trace replay), against a fake clock.

Each test pins one rule of `Channel.form` / `LongShare` that the replay measured:
see docs/benchmarks.md, "Bursty, mixed-size traffic".
"""

from __future__ import annotations

import itertools

import pytest

from dynbatchd.config import ChannelSettings
from dynbatchd.scheduler import MS, Item, Scheduler, build_channels
from dynbatchd.scheduler.longshare import LongShare

_keys = itertools.count(1)


def item(at_ms: float, tokens: int, deadline_ms: float = 1000) -> Item:
    at = int(at_ms * MS)
    return Item(next(_keys), "m", at, at + int(deadline_ms * MS), tokens, None, None, "c")


def scheduler(max_batch: int, long_share: float = 0.9) -> Scheduler:
    s = Scheduler(build_channels({"c": ChannelSettings(max_batch=max_batch, window_ms=0, long_share=long_share)}))
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


def _first_batch(long_price: float, long_share: float = 0.9) -> list[int]:
    """The first batch planned of four requests due at 36 ms, two at a time, a long request
    (above 5,250 tokens) worth 1 + `long_price` requests."""
    s = scheduler(max_batch=2, long_share=long_share)
    for it in [item(0, t, deadline_ms=36) for t in (100, 9000, 120, 2000)]:
        assert s.submit(it, 0)
    ledger = s.channels["c"].long_ledger
    ledger.cut, ledger.price = 5000.0, long_price
    assert s.channels["c"].snapshot(0)["long_price"] == long_price   # what `status` shows
    [batch] = s.poll(0, free_slots=1).batches
    return [it.tokens for it in batch.items]


def test_the_plan_drops_the_most_device_time_per_request_it_counts():
    # Batches take 8 ms + 0.5 ms a request + 0.002 ms a token: all four need 40.4 ms, so one
    # leaves the plan. Unpriced, the largest (9,000 tokens, 18.5 ms of its own) goes and the
    # first batch is the two short ones. At a price of 3 the long one counts 4 requests, 4.6 ms
    # each, still more than the 2,000 (4.5 ms): it goes. At 4 it counts 5, 3.7 ms each, so the
    # 2,000 goes instead, and the rest (35.9 ms) still ends by 36 ms: the long one runs first.
    assert _first_batch(long_price=0.0) == [100, 120]
    assert _first_batch(long_price=3.0) == [100, 120]
    assert _first_batch(long_price=4.0) == [100, 9000]


def test_a_channel_with_long_share_0_prices_long_requests_at_nothing():
    # The same queue, a price of 4 left from before the operator set long_share = 0 (tune): the
    # rule is off at once, and the plan drops the largest, long or not.
    assert _first_batch(long_price=4.0, long_share=0.9) == [100, 9000]
    assert _first_batch(long_price=4.0, long_share=0.0) == [100, 120]


def test_the_price_of_a_long_request_rises_while_owed_and_falls_back_to_zero():
    ledger = LongShare(memory=100)   # a step of 1/100 a request
    ledger.fifo_long, ledger.done_long = 10.0, 1.0   # the plan served a tenth of what FIFO would have
    for _ in range(50):
        ledger.arrived(100, 0.7e6)
    assert ledger.price == pytest.approx(0.5)
    ledger.done_long = 10.0                          # caught up: no longer owed
    for _ in range(30):
        ledger.arrived(100, 0.7e6)
    assert ledger.price == pytest.approx(0.2)
    for _ in range(30):
        ledger.arrived(100, 0.7e6)
    assert ledger.price == 0.0                       # never under 0


def test_the_price_stays_at_zero_where_the_channel_owes_long_requests_nothing():
    ledger = LongShare(memory=100)
    ledger.share = 0.0                               # the channel's long_share = 0
    ledger.fifo_long, ledger.done_long = 10.0, 1.0
    for _ in range(50):
        ledger.arrived(100, 0.7e6)
    assert ledger.price == 0.0


def test_a_ledger_is_owed_up_to_the_share_asked():
    ledger = LongShare()
    ledger.fifo_long, ledger.done_long = 10.0, 8.5
    assert [ledger.owed(share) for share in (0.0, 0.8, 0.85, 0.9, 1.0)] == [False, False, False, True, True]


def _ledger(burst_ms: float, burst_long_served: bool) -> LongShare:
    """1,000 requests over 10 s (a tenth long, 5,000 tokens), all served; then 200 more within
    `burst_ms`, of which the plan serves the short ones, and the long ones if `burst_long_served`."""
    ledger = LongShare()
    ledger.batch_ns, ledger.max_batch = 8e6, 32
    cost = {100: 0.7e6, 5000: 10.5e6}
    for i in range(1200):
        at = int(i * 10 * MS) if i < 1000 else int((10_000 + (i - 1000) * burst_ms / 200) * MS)
        tokens = 5000 if i % 10 == 5 else 100
        ledger.arrived(tokens, cost[tokens], at, at + 1000 * MS)
        if i < 1000 or burst_long_served or tokens == 100:
            ledger.served([tokens])
    return ledger


def test_long_requests_are_owed_what_fifo_would_have_served_them():
    # 200 requests over 2 s fit the device: FIFO serves the 20 long ones, a plan that serves none of
    # them has ~80 of FIFO's ~100 lately, under 0.9 of them: owed.
    assert _ledger(burst_ms=2000, burst_long_served=True).owed() is False
    assert _ledger(burst_ms=2000, burst_long_served=False).owed() is True


def test_long_requests_are_not_owed_what_fifo_could_not_have_served_either():
    # 200 at once (~1.2 s of device time, due in 1 s): the shadow FIFO drops what it cannot finish
    # in time and counts a request only once it runs, so it has served few of the burst's long
    # ones yet. The plan, which served none of them, owes nothing.
    ledger = _ledger(burst_ms=0, burst_long_served=False)
    assert ledger.owed() is False
    assert ledger.done_long >= LongShare.FIFO_SHARE * ledger.fifo_long


def _ledger_sharing(stretch: float) -> LongShare:
    """As `_ledger`, the burst of 200 within 500 ms, its long ones not served, while channels of
    higher priority take all but 1/`stretch` of the device."""
    ledger = LongShare()
    ledger.batch_ns, ledger.max_batch = 8e6, 32
    cost = {100: 0.7e6, 5000: 10.5e6}
    for i in range(1200):
        at = int(i * 10 * MS) if i < 1000 else int((10_000 + (i - 1000) * 2.5) * MS)
        ledger.stretch = 1.0 if i < 1000 else stretch
        tokens = 5000 if i % 10 == 5 else 100
        ledger.arrived(tokens, cost[tokens], at, at + 1000 * MS)
        if i < 1000 or tokens == 100:
            ledger.served([tokens])
    return ledger


def test_the_shadow_fifo_runs_on_the_device_time_channels_above_leave():
    # Alone on the device FIFO would have served the burst's 20 long requests: owed. With a realtime
    # channel taking three quarters of the device the burst needs ~1.6 s, past its deadline: FIFO
    # would have served few of them, so the plan owes them nothing.
    assert _ledger_sharing(stretch=1.0).owed() is True
    assert _ledger_sharing(stretch=4.0).owed() is False


def test_a_channel_s_stretch_is_the_device_time_channels_above_it_took():
    s = Scheduler(build_channels({"realtime": ChannelSettings(max_batch=8, window_ms=0, priority=2),
                                  "standard": ChannelSettings(max_batch=8, window_ms=0, priority=1),
                                  "bulk": ChannelSettings(max_batch=8, window_ms=0, priority=0)}))
    assert s._stretch(s.channels["standard"]) == 1.0               # nothing dispatched yet
    s._recent.update(realtime=3.0, standard=0.5, bulk=0.5)
    assert s._stretch(s.channels["standard"]) == 4.0               # realtime took 3/4
    assert s._stretch(s.channels["realtime"]) == 1.0               # nothing above it
    assert s._stretch(s.channels["bulk"]) == 1 / (1 - 3.5 / 4)     # both above it
