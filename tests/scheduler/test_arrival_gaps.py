"""When a lower channel's request that outlasts what realtime can wait may start (`ArrivalGaps`,
`Scheduler._held_until`), against a fake clock: no sockets, no sleeps, exact times."""

from __future__ import annotations

import itertools
import random

from dynbatchd.config import ChannelSettings
from dynbatchd.scheduler import MS, Item, Scheduler, build_channels
from dynbatchd.scheduler.arrivalgaps import ArrivalGaps

STEP = 375 * MS   # the Mooncake trace's 3 s steps at x8
WIDTH = 60 * MS   # a bulk request of 250 ms beside a realtime deadline of 200 ms, its own run 10 ms
NEVER = 10 ** 18

_keys = itertools.count(1)


def stepped(steps: int = 100, every_third_skipped: bool = True) -> ArrivalGaps:
    """Arrivals at whole steps only (several at once at some), a step without any now and then."""
    gaps = ArrivalGaps()
    for k in range(steps):
        if every_third_skipped and k % 3 == 2:
            continue
        for _ in range(1 + k % 2):
            gaps.arrived(k * STEP)
    return gaps


def test_arrivals_at_one_instant_are_one_and_a_step_apart_is_one_gap():
    gaps = stepped(4, every_third_skipped=False)
    assert gaps.last_ns == 3 * STEP
    assert gaps.chance(0, STEP, sorted(gaps._gaps)) is None   # three gaps: too few to say
    assert sorted(gaps._gaps) == [STEP] * 3


def test_a_step_spread_over_a_millisecond_is_one_instant_and_the_gap_runs_from_its_last():
    """Live, a step's requests reach the daemon a fraction of a millisecond apart: those gaps read
    as "the next request comes at once", and no later start looked safer than now."""
    gaps = ArrivalGaps()
    for k in range(3):
        for spread in (0, 300_000, 700_000):   # 0.3 and 0.7 ms after the step's first
            gaps.arrived(k * STEP + spread)
    assert sorted(gaps._gaps) == [STEP - 700_000] * 2 and gaps.last_ns == 2 * STEP + 700_000


def test_just_before_a_step_a_long_run_waits_until_just_past_it():
    gaps = stepped()
    last = gaps.last_ns
    assert last == 99 * STEP
    # 340 ms after the last arrival: a 60 ms exposure covers the next step. Just past it, either a
    # request came (the next gap starts afresh: none comes within 60 ms of one) or none did.
    assert gaps.safer_start(last + 340 * MS, WIDTH, NEVER) == last + STEP + 1
    # 100 ms after it the exposure ends before the next step: at once.
    assert gaps.safer_start(last + 100 * MS, WIDTH, NEVER) == last + 100 * MS
    # Never past the latest start the request's own deadline allows.
    assert gaps.safer_start(last + 340 * MS, WIDTH, last + STEP) == last + 340 * MS


def test_random_arrivals_never_make_a_later_start_safer():
    rng = random.Random(5)
    gaps, at = ArrivalGaps(), 0
    for _ in range(ArrivalGaps.MEMORY + 1):
        at += int(rng.expovariate(1 / (700 * MS)))
        gaps.arrived(at)
    held = [q for q in range(0, 3000 * MS, 5 * MS) if gaps.safer_start(at + q, 80 * MS, NEVER) != at + q]
    assert held == []


def test_too_few_arrivals_or_nothing_exposed_never_hold():
    gaps = stepped(10)   # 6 gaps
    assert gaps.safer_start(gaps.last_ns + 340 * MS, WIDTH, NEVER) == gaps.last_ns + 340 * MS
    gaps = stepped()
    assert gaps.safer_start(gaps.last_ns + 340 * MS, 0, NEVER) == gaps.last_ns + 340 * MS


def scheduler_beside_stepped_realtime(bulk_tokens: int, bulk_deadline_ms: float = 30_000) -> tuple[Scheduler, int]:
    """The shipped realtime and bulk channels (8 ms + 0.002 ms a token, learned), realtime requests
    of 1k tokens arriving at whole steps of 375 ms and served; then, 340 ms after the last step, a
    bulk request of `bulk_tokens`. (The scheduler, the time of the last step.)"""
    s = Scheduler(build_channels({
        "realtime": ChannelSettings(max_batch=16, window_ms=30, deadline_ms=200, priority=2),
        "bulk": ChannelSettings(max_batch=8, window_ms=0, deadline_ms=30_000, priority=0)}))
    for name in s.channels:
        for n, tokens in ((1, 1_000), (4, 40_000), (2, 90_000)) * 10:
            s.channels[name].cost.observe(n, tokens, int((8 + 0.002 * tokens) * MS))
    for k in range(100):
        if k % 3 == 2:
            continue
        at = k * STEP
        assert s.submit(Item(next(_keys), "m", at, at + 200 * MS, 1_000, None, None, "realtime"), at)
        assert [b.channel for b in s.poll(at + 30 * MS, free_slots=1).batches] == ["realtime"]
    last = 99 * STEP
    now = last + 340 * MS
    bulk = Item(next(_keys), "m", now, now + int(bulk_deadline_ms * MS), bulk_tokens, None, None, "bulk")
    assert s.submit(bulk, now)
    return s, last


def test_a_bulk_request_longer_than_realtime_can_wait_starts_just_past_the_next_step():
    # 121k tokens run 250 ms: started 35 ms before the step, a realtime request arriving at the
    # step would wait 215 ms for it. The device waits until just past the step instead.
    s, last = scheduler_beside_stepped_realtime(121_000)
    now = last + 340 * MS
    assert s.poll(now, free_slots=1).batches == []
    assert s.next_wakeup(now, free_slots=1) == last + STEP + 1
    assert [b.channel for b in s.poll(last + STEP + 1, free_slots=1).batches] == ["bulk"]


def test_a_bulk_request_realtime_can_wait_for_or_one_due_soon_starts_at_once():
    s, last = scheduler_beside_stepped_realtime(60_000)   # 128 ms: a realtime request arriving waits it out in time
    assert [b.channel for b in s.poll(last + 340 * MS, free_slots=1).batches] == ["bulk"]
    s, last = scheduler_beside_stepped_realtime(121_000, bulk_deadline_ms=300)   # 50 ms of slack: none to wait in
    assert [b.channel for b in s.poll(last + 340 * MS, free_slots=1).batches] == ["bulk"]


def test_a_quiet_realtime_channel_holds_nothing():
    s, last = scheduler_beside_stepped_realtime(121_000)
    later = last + 20_000 * MS   # realtime has had no request for 20 s (`Channel.quiet`)
    assert [b.channel for b in s.poll(later, free_slots=1).batches] == ["bulk"]
