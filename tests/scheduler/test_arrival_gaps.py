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
    assert sorted(gaps._gaps) == [STEP] * 3
    assert gaps.safer_start(gaps.last_ns + 340 * MS, WIDTH, NEVER) is None   # three gaps: too few to say


def test_what_usually_arrives_at_once_is_the_90th_percentile_of_the_instants_closed():
    gaps = ArrivalGaps()
    assert gaps.usual_instant() == (0, 0)
    for k in range(11):   # instants of 1 request of 1k tokens but one of 4 requests of 6k in all
        for _ in range(4 if k == 5 else 1):
            gaps.arrived(k * STEP, 6_000 // 4 if k == 5 else 1_000)
    assert gaps.usual_instant() == (1, 1_000)   # ten closed: the one big is above the 90th
    for k in range(11, 13):
        for _ in range(4):
            gaps.arrived(k * STEP, 1_500)
    assert gaps.usual_instant() == (4, 6_000)   # twelve closed, two of them big


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


def test_a_step_that_comes_a_little_early_or_late_is_waited_out_to_its_latest():
    """Live, steps come a fraction of a millisecond early or late. Just past the usual gap is past
    the longest of those within a millisecond or two of each other: 0.08 ms short of it, the
    step still to come met a 224 ms bulk run at once (the live Mooncake replay at x12)."""
    rng = random.Random(3)
    gaps, at = ArrivalGaps(), 0
    for k in range(200):
        at = k * STEP + rng.choice((-100_000, 0, 0, 0, 0, 0, 0, 100_000))
        gaps.arrived(at)
    latest_usual = max(g for g in gaps._gaps if g < STEP + ArrivalGaps.ONE_INSTANT_NS)
    assert latest_usual > STEP   # (a step came late after one that came early)
    assert gaps.safer_start(at + 340 * MS, WIDTH, NEVER) == at + latest_usual + 1


def test_random_arrivals_never_make_a_later_start_safer():
    rng = random.Random(5)
    gaps, at = ArrivalGaps(), 0
    for _ in range(ArrivalGaps.MEMORY + 1):
        at += int(rng.expovariate(1 / (700 * MS)))
        gaps.arrived(at)
    said = {q: gaps.safer_start(at + q, 80 * MS, NEVER) for q in range(0, 3000 * MS, 5 * MS)}
    assert [q for q, start in said.items() if start not in (at + q, None)] == []
    assert said[0] == at   # (None only where the quiet outran nearly every gap)


def test_too_few_arrivals_or_nothing_exposed_never_hold():
    gaps = stepped(10)   # 6 gaps: too few to say
    assert gaps.safer_start(gaps.last_ns + 340 * MS, WIDTH, NEVER) is None
    gaps = stepped()
    assert gaps.safer_start(gaps.last_ns + 340 * MS, 0, NEVER) == gaps.last_ns + 340 * MS


def stepped_realtime_scheduler(per_step: int = 1, tokens: int = 1_000) -> tuple[Scheduler, int]:
    """The shipped realtime and bulk channels (8 ms + 0.002 ms a token, learned), `per_step`
    realtime requests of `tokens` arriving at whole steps of 375 ms and served. (The scheduler,
    its last step.)"""
    s = Scheduler(build_channels({
        "realtime": ChannelSettings(max_batch=16, window_ms=30, deadline_ms=200, priority=2),
        "bulk": ChannelSettings(max_batch=8, window_ms=0, deadline_ms=30_000, priority=0)}))
    for name in s.channels:
        for n, seen in ((1, 1_000), (4, 40_000), (2, 90_000)) * 10:
            s.channels[name].cost.observe(n, seen, int((8 + 0.002 * seen) * MS))
    for k in range(100):
        if k % 3 == 2:
            continue
        at = k * STEP
        for _ in range(per_step):
            assert s.submit(Item(next(_keys), "m", at, at + 200 * MS, tokens, None, None, "realtime"), at)
        assert [b.channel for b in s.poll(at + 30 * MS, free_slots=1).batches] == ["realtime"]
    return s, 99 * STEP


def bulk(at: int, tokens: int, deadline_ms: float = 30_000) -> Item:
    return Item(next(_keys), "m", at, at + int(deadline_ms * MS), tokens, None, None, "bulk")


def scheduler_beside_stepped_realtime(bulk_tokens: int, bulk_deadline_ms: float = 30_000) -> tuple[Scheduler, int]:
    """`stepped_realtime_scheduler`; then, 340 ms after the last step, a bulk request of `bulk_tokens`."""
    s, last = stepped_realtime_scheduler()
    now = last + 340 * MS
    assert s.submit(bulk(now, bulk_tokens, bulk_deadline_ms), now)
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


def test_handed_to_a_busy_device_a_run_is_exposed_from_the_hand_over():
    """Handed over 35 ms before a step to a device busy for 40 ms more, the run starts 5 ms past
    the step, yet the step's realtime requests cannot go first: they wait behind it (the live
    Mooncake replay at x12, a realtime request late behind a bulk run that started 3 ms past a
    step). It waits until just past the step to be handed over."""
    s, last = scheduler_beside_stepped_realtime(121_000)
    now = last + 340 * MS
    assert s.poll(now, free_slots=1, device_busy_ns=40 * MS).batches == []
    assert s.next_wakeup(now, free_slots=1, device_busy_ns=40 * MS) == last + STEP + 1


def test_what_realtime_can_wait_is_read_for_the_requests_a_step_brings_at_once():
    """A step of three realtime requests of 5k tokens runs 38 ms where one runs 18: a bulk run of
    175 ms, which one of them alone could wait out, makes the three late if it starts 10 ms before
    the step (the live Mooncake replay at x12: two of three urgent requests of a step late)."""
    s, last = stepped_realtime_scheduler(per_step=3, tokens=5_000)
    assert s.channels["realtime"].arrival_gaps.usual_instant() == (3, 15_000)
    now = last + 365 * MS
    assert s.submit(bulk(now - 5_000 * MS, 83_500), now - 5_000 * MS)   # (queued 5 s: not itself an arrival now)
    assert s.poll(now, free_slots=1).batches == []
    assert [b.channel for b in s.poll(last + STEP + 1, free_slots=1).batches] == ["bulk"]


def test_past_every_gap_realtime_has_had_the_steps_of_all_traffic_say_when():
    """Realtime's own gaps cannot say once it has been quiet longer than nearly all of them (1.5 s
    where they run 0.25 s to 1 s): the steps all channels' requests arrive at still can."""
    s, _ = stepped_realtime_scheduler()
    for k in range(100, 106):   # small bulk requests at each step, none from realtime
        assert s.submit(bulk(k * STEP, 1_000), k * STEP)
        assert [b.channel for b in s.poll(k * STEP, free_slots=1).batches] == ["bulk"]
    assert s.submit(bulk(106 * STEP, 121_000), 106 * STEP)   # 250 ms; the device is busy until 340 ms past the step
    quiet = 106 * STEP + 340 * MS   # realtime's last request came 2.6 s ago
    assert s.channels["realtime"].arrival_gaps.safer_start(quiet, WIDTH, NEVER) is None
    assert s.poll(quiet, free_slots=1).batches == []
    assert s.next_wakeup(quiet, free_slots=1) == 107 * STEP + 1


def test_a_quiet_realtime_channel_holds_nothing():
    s, last = scheduler_beside_stepped_realtime(121_000)
    later = last + 20_000 * MS   # realtime has had no request for 20 s (`Channel.quiet`)
    assert [b.channel for b in s.poll(later, free_slots=1).batches] == ["bulk"]


def test_a_run_realtime_could_wait_for_alone_is_held_behind_a_long_one_on_the_device():
    """A bulk run of 128 ms, which realtime could wait for alone, handed 35 ms before a step to a
    device busy for 100 ms more: a request arriving at the step waits out both (228 ms) and
    misses its 200 ms. It waits until just past the step to be handed over."""
    s, last = scheduler_beside_stepped_realtime(60_000)
    now = last + 340 * MS
    assert s.poll(now, free_slots=1, device_busy_ns=100 * MS).batches == []
    assert s.next_wakeup(now, free_slots=1, device_busy_ns=100 * MS) == last + STEP + 1
    assert [b.channel for b in s.poll(now, free_slots=1, device_busy_ns=20 * MS).batches] == ["bulk"]
