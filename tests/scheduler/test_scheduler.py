"""Scheduler rules against a fake clock: no sockets, no sleeps, exact times."""

from __future__ import annotations

import itertools

from dynbatchd.config import ChannelSettings
from dynbatchd.scheduler import MS, CostModel, Item, Scheduler, build_channels

_keys = itertools.count(1)


def make(**channels: ChannelSettings) -> Scheduler:
    return Scheduler(build_channels(channels))


def item(channel: str, at_ms: float, *, deadline_ms: float = 1000, model: str = "m", tokens: int = 0,
         tenant: str | None = None) -> Item:
    at = int(at_ms * MS)
    return Item(next(_keys), model, at, at + int(deadline_ms * MS), tokens, tenant, None, channel)


def submit_all(s: Scheduler, items: list[Item]) -> None:
    for it in items:
        assert s.submit(it, it.arrival_ns)


def test_batch_closes_when_full_before_window():
    s = make(c=ChannelSettings(max_batch=4, window_ms=100))
    submit_all(s, [item("c", 0), item("c", 1), item("c", 2)])
    assert s.poll(2 * MS, free_slots=1).batches == []
    submit_all(s, [item("c", 3)])
    [batch] = s.poll(3 * MS, free_slots=1).batches
    assert len(batch.items) == 4 and batch.formed_ns == 3 * MS


def test_batch_closes_when_window_expires_and_not_before():
    s = make(c=ChannelSettings(max_batch=8, window_ms=30))
    submit_all(s, [item("c", 0), item("c", 10)])
    assert s.next_wakeup(10 * MS, free_slots=1) == 30 * MS
    assert s.poll(29 * MS, free_slots=1).batches == []
    [batch] = s.poll(30 * MS, free_slots=1).batches
    assert [it.arrival_ns for it in batch.items] == [0, 10 * MS]


def test_no_free_slot_means_no_batch_and_ready_lane_does_not_spin():
    s = make(c=ChannelSettings(max_batch=2, window_ms=10))
    submit_all(s, [item("c", 0, deadline_ms=500), item("c", 0, deadline_ms=500)])
    assert s.poll(0, free_slots=0).batches == []
    # Ready and waiting for a slot: the only timed event left is its expiry.
    assert s.next_wakeup(0, free_slots=0) == 500 * MS + 1
    assert len(s.poll(1 * MS, free_slots=1).batches) == 1


def test_earliest_deadline_first_across_channels():
    s = make(slow=ChannelSettings(max_batch=1, window_ms=0, deadline_ms=900),
             fast=ChannelSettings(max_batch=1, window_ms=0, deadline_ms=50))
    submit_all(s, [item("slow", 0, deadline_ms=900), item("fast", 5, deadline_ms=50)])
    first, second = s.poll(5 * MS, free_slots=2).batches
    assert (first.channel, second.channel) == ("fast", "slow")


def test_deadline_order_within_a_channel():
    s = make(c=ChannelSettings(max_batch=2, window_ms=0))
    late, urgent, mid = item("c", 0, deadline_ms=900), item("c", 1, deadline_ms=20), item("c", 2, deadline_ms=100)
    submit_all(s, [late, urgent, mid])
    batch = s.poll(2 * MS, free_slots=1).batches[0]
    assert batch.items == [urgent, mid]


def test_isolated_channel_never_mixes_tenants_or_channels():
    s = make(bank=ChannelSettings(max_batch=8, window_ms=0, isolated=True),
             std=ChannelSettings(max_batch=8, window_ms=0))
    submit_all(s, [item("bank", 0, tenant="a"), item("bank", 0, tenant="b"), item("bank", 0, tenant="a"),
                   item("std", 0, tenant="a"), item("std", 0, tenant="b")])
    batches = s.poll(0, free_slots=5).batches
    groups = sorted((b.channel, tuple(sorted({i.tenant for i in b.items})), len(b.items)) for b in batches)
    assert groups == [("bank", ("a",), 2), ("bank", ("b",), 1), ("std", ("a", "b"), 2)]


def test_models_never_share_a_batch():
    s = make(c=ChannelSettings(max_batch=8, window_ms=0))
    submit_all(s, [item("c", 0, model="x"), item("c", 0, model="y"), item("c", 0, model="x")])
    batches = s.poll(0, free_slots=4).batches
    assert sorted((b.model, len(b.items)) for b in batches) == [("x", 2), ("y", 1)]


def test_bounded_queue_rejects_when_full():
    s = make(c=ChannelSettings(max_batch=8, window_ms=50, queue_limit=2))
    assert s.submit(item("c", 0), 0) and s.submit(item("c", 0), 0)
    assert not s.submit(item("c", 0), 0)
    assert s.channels["c"].stats.overloaded == 1 and s.depth() == 2


def test_expired_requests_are_returned_not_run():
    s = make(c=ChannelSettings(max_batch=8, window_ms=500, deadline_ms=600))
    old = item("c", 0, deadline_ms=100)
    fresh = item("c", 50, deadline_ms=600)
    submit_all(s, [old, fresh])
    # The device stays busy: the old request cannot start before its deadline.
    assert s.next_wakeup(50 * MS, free_slots=0) == 100 * MS + 1
    assert s.poll(100 * MS, free_slots=0).expired == []
    decision = s.poll(100 * MS + 1, free_slots=0)
    assert decision.expired == [old] and decision.batches == []
    assert s.channels["c"].stats.expired == 1 and s.depth() == 1


def test_run_late_channel_runs_expired_requests_at_once():
    s = make(c=ChannelSettings(max_batch=8, window_ms=500, deadline_ms=600, run_late=True))
    late = item("c", 0, deadline_ms=100)
    submit_all(s, [late])
    decision = s.poll(200 * MS, free_slots=1)
    assert decision.expired == [] and decision.batches[0].items == [late]


def test_closes_early_when_waiting_would_miss_the_deadline():
    s = make(c=ChannelSettings(max_batch=8, window_ms=100, deadline_ms=1000))
    s.channels["c"].cost.observe(1, 0, 20 * MS)   # the device takes 20 ms per batch
    submit_all(s, [item("c", 0, deadline_ms=50)])
    # Must start by 50 - 20 = 30 ms (a ns sooner: the estimate is truncated), well before the 100 ms window ends.
    assert s.next_wakeup(0, free_slots=1) == 30 * MS - 1
    assert s.poll(29 * MS, free_slots=1).batches == []
    assert len(s.poll(30 * MS, free_slots=1).batches) == 1


def test_token_cap_closes_and_limits_a_batch():
    s = make(c=ChannelSettings(max_batch=32, window_ms=100, max_tokens=1000))
    submit_all(s, [item("c", 0, tokens=400), item("c", 1, tokens=400), item("c", 2, tokens=400)])
    [batch] = s.poll(2 * MS, free_slots=1).batches
    assert batch.tokens == 800 and len(batch.items) == 2


def test_drain_makes_everything_ready():
    s = make(c=ChannelSettings(max_batch=32, window_ms=1000))
    submit_all(s, [item("c", 0)])
    assert s.poll(0, free_slots=1).batches == []
    s.drain()
    assert len(s.poll(0, free_slots=1).batches) == 1


def test_requeued_items_run_again_first_and_alone():
    s = make(c=ChannelSettings(max_batch=4, window_ms=0))
    a, b, c = item("c", 0), item("c", 0), item("c", 1)
    submit_all(s, [a, b])
    [batch] = s.poll(0, free_slots=1).batches
    for it in batch.items:        # their worker died running them: one of them may be what killed it
        it.retries += 1
    s.requeue(batch.items)
    submit_all(s, [c])
    batches = s.poll(1 * MS, free_slots=3).batches
    assert [x.items for x in batches] == [[a], [b], [c]] and a.retries == 1


def test_minimum_share_lets_a_starved_channel_through_when_its_request_can_wait_no_longer():
    def picks(min_share: float) -> list[str]:
        s = make(hot=ChannelSettings(max_batch=1, window_ms=0, deadline_ms=10_000, priority=5),
                 cold=ChannelSettings(max_batch=1, window_ms=0, deadline_ms=60_000, min_share=min_share))
        for t in range(20):   # all due at 22 ms, as is the cold one: at 22 ms every one is urgent
            s.submit(item("hot", t, deadline_ms=22 - t), t * MS)
        s.submit(item("cold", 0, deadline_ms=22), 0)
        return [s.poll(22 * MS, free_slots=1).batches[0].channel for _ in range(3)]
    # Without a minimum share, the higher priority's urgent requests go first; with one, the starved
    # channel's urgent request does.
    assert picks(0.0) == ["hot", "hot", "hot"]
    assert picks(0.2)[0] == "cold"


def test_minimum_share_does_not_take_the_device_for_a_request_that_can_still_wait():
    s = make(hot=ChannelSettings(max_batch=1, window_ms=0, deadline_ms=10_000, priority=5),
             cold=ChannelSettings(max_batch=1, window_ms=0, deadline_ms=60_000, min_share=0.2))
    for t in range(20):
        s.submit(item("hot", t, deadline_ms=100), t * MS)
    s.submit(item("cold", 0, deadline_ms=60_000), 0)
    picked = [s.poll((20 + t) * MS, free_slots=1).batches[0].channel for t in range(20)]
    # Starved, but due in a minute: the hot burst due in 100 ms runs first, the cold request after it.
    assert picked == ["hot"] * 20
    assert s.poll(40 * MS, free_slots=1).batches[0].channel == "cold"


def test_completed_batches_teach_the_cost_model():
    s = make(c=ChannelSettings(max_batch=32, window_ms=0))
    for n in (1, 4, 16, 32):
        submit_all(s, [item("c", 0) for _ in range(n)])
        [batch] = s.poll(0, free_slots=1).batches
        s.completed(batch, int((8 + 0.5 * n) * MS), 0)
    cost = s.channels["c"].cost
    assert abs(cost.estimate_ns(32) - 24 * MS) < 0.01 * MS
    assert abs(cost.estimate_ns(1) - 8.5 * MS) < 0.01 * MS


def test_out_of_memory_lowers_the_channel_limit():
    s = make(c=ChannelSettings(max_batch=32, window_ms=0))
    submit_all(s, [item("c", 0) for _ in range(32)])
    [batch] = s.poll(0, free_slots=1).batches
    s.out_of_memory(batch)
    assert s.channels["c"].sizer.max_batch() == 16


def test_thousands_of_arrivals_replay_fast_and_every_request_is_accounted_for():
    s = make(c=ChannelSettings(max_batch=16, window_ms=5, deadline_ms=40, queue_limit=64))
    now, done, expired, rejected, busy_until = 0, 0, 0, 0, 0
    for k in range(5000):
        now = k * MS // 2   # 2000 req/s into a device that does 16 per 10 ms = 1600/s
        if not s.submit(item("c", now / MS, deadline_ms=40), now):
            rejected += 1
        free = 1 if now >= busy_until else 0
        d = s.poll(now, free)
        expired += len(d.expired)
        for b in d.batches:
            busy_until = now + 10 * MS
            done += len(b.items)
    s.drain()
    d = s.poll(now + 10 * MS, 1)
    done += sum(len(b.items) for b in d.batches)
    expired += len(d.expired)
    assert done + expired + rejected + s.depth() == 5000
    assert rejected > 0 and done > 3000


def test_under_overload_realtime_keeps_its_deadline_and_standard_absorbs_the_delay():
    s = make(realtime=ChannelSettings(max_batch=4, window_ms=0, deadline_ms=70, priority=2),
             standard=ChannelSettings(max_batch=4, window_ms=0, deadline_ms=1000, priority=1))
    for _ in range(CostModel.SETTLED_AFTER):   # a settled cost: expiry may refuse on it
        s.channels["realtime"].cost.observe(4, 0, 40 * MS)
        s.channels["standard"].cost.observe(4, 0, 40 * MS)
    # Batches take 40 ms. A standard request that has waited 930 ms is due at 1000 ms; a fresh
    # realtime one at 1000 ms too. Only one can start now; the other could only end at 1010.
    old_standard = item("standard", 0, deadline_ms=1000)
    fresh_realtime = item("realtime", 930, deadline_ms=70)
    submit_all(s, [old_standard, fresh_realtime])
    first = s.poll(930 * MS, free_slots=1).batches[0]
    assert first.channel == "realtime"   # both urgent: the higher priority goes first
    # By then standard cannot finish in time: it is answered, not run late on a busy device.
    assert s.poll(970 * MS, free_slots=1).expired == [old_standard]


def _realtime_in_its_window_beside_bulk(bulk_tokens: int) -> str:
    """The channel a free device serves first: a realtime request just arrived (30 ms window,
    200 ms deadline), a bulk request of `bulk_tokens` ready (8 ms + 0.002 ms a token, learned)."""
    s = make(realtime=ChannelSettings(max_batch=16, window_ms=30, deadline_ms=200, priority=2),
             bulk=ChannelSettings(max_batch=8, window_ms=0, deadline_ms=30_000, priority=0))
    for name in s.channels:
        for n, tokens in ((1, 1_000), (4, 40_000), (2, 90_000)) * 10:
            s.channels[name].cost.observe(n, tokens, int((8 + 0.002 * tokens) * MS))
    submit_all(s, [item("bulk", 0, deadline_ms=30_000, tokens=bulk_tokens), item("realtime", 0, deadline_ms=200, tokens=1_000)])
    return s.poll(0, free_slots=1).batches[0].channel


def test_a_request_in_its_window_goes_first_when_a_lower_channels_request_would_outlast_its_deadline():
    # 95k tokens run 198 ms on a device that cannot be preempted: the realtime request, waiting out
    # its window, could then only end at 208 ms. Its window closes now instead.
    assert _realtime_in_its_window_beside_bulk(95_000) == "realtime"
    # A bulk request of 28 ms leaves it time to fill its window and still end in time.
    assert _realtime_in_its_window_beside_bulk(10_000) == "bulk"


def test_a_ready_lane_above_is_not_put_before_an_earlier_deadline_by_the_window_rule():
    # The realtime request is ready (window 0) and not urgent: the batches the channels usually
    # cut (requests of ~200 tokens) leave it time. A bulk request of 300k tokens (608 ms) is due
    # first, at 612 ms, and runs: the realtime one, due at 615 ms, will end late behind it; served
    # first, the bulk one would (either way one of two is late). Only a lane still in its window
    # is brought forward (`_waiting_above`): a ready one was weighed by urgency and deadline
    # already. Bringing ready ones forward too cost the Mooncake trace's realtime requests with
    # 10% urgent traffic 0.15 points at x12 (98.66% against 98.81%, docs/benchmarks.md).
    s = make(realtime=ChannelSettings(max_batch=16, window_ms=0, deadline_ms=1000, priority=2),
             bulk=ChannelSettings(max_batch=8, window_ms=0, deadline_ms=30_000, priority=0))
    for name in s.channels:
        for n, tokens in ((1, 1_000), (4, 40_000), (2, 90_000)) * 10:
            s.channels[name].cost.observe(n, tokens, int((8 + 0.002 * tokens) * MS))
    for _ in range(20):   # (the channels' running mean request: ~200 tokens after these)
        submit_all(s, [item("bulk", 0, deadline_ms=30_000, tokens=1000), item("realtime", 0, tokens=1000)])
        s.poll(0, free_slots=8)
    submit_all(s, [item("bulk", 0, deadline_ms=612, tokens=300_000), item("realtime", 0, deadline_ms=615, tokens=1_000)])
    assert s.poll(0, free_slots=1).batches[0].channel == "bulk"


def test_not_urgent_work_is_earliest_deadline_first_whatever_the_priority():
    s = make(realtime=ChannelSettings(max_batch=1, window_ms=0, deadline_ms=5000, priority=9),
             standard=ChannelSettings(max_batch=1, window_ms=0, deadline_ms=1000, priority=0))
    submit_all(s, [item("realtime", 0, deadline_ms=5000), item("standard", 0, deadline_ms=1000)])
    assert s.poll(0, free_slots=1).batches[0].channel == "standard"


def test_token_buckets_keep_short_requests_apart_from_long_ones():
    s = make(c=ChannelSettings(max_batch=8, window_ms=0, token_buckets=[512, 4096]))
    submit_all(s, [item("c", 0, tokens=100), item("c", 0, tokens=9000), item("c", 0, tokens=300),
                   item("c", 0, tokens=2000), item("c", 0, tokens=512)])
    batches = s.poll(0, free_slots=4).batches
    assert sorted(sorted(i.tokens for i in b.items) for b in batches) == [[100, 300, 512], [2000], [9000]]


def test_minimum_share_follows_recent_dispatches_not_lifetime_totals():
    s = make(a=ChannelSettings(max_batch=1, window_ms=0, min_share=0.3, deadline_ms=60_000),
             b=ChannelSettings(max_batch=1, window_ms=0, deadline_ms=60_000, priority=1))
    # Long ago, `a` was served 200 times; afterwards `b`, of higher priority, floods, and every
    # request of both is due now: none can wait (the rule a minimum share acts on).
    for t in range(200):
        s.submit(item("a", t, deadline_ms=60_000), t * MS)
        s.poll(t * MS, free_slots=1)
    for t in range(200, 1200):
        s.submit(item("b", t, deadline_ms=1200 - t), t * MS)
        s.submit(item("a", t, deadline_ms=1200 - t), t * MS)
    served = [s.poll(1200 * MS, free_slots=1).batches[0].channel for _ in range(800)]
    # Priority alone would serve only b; `a` gets its share back once its old dispatches have
    # faded, instead of being judged on lifetime totals forever.
    assert served[:50].count("a") == 0
    assert 0.25 <= served[-200:].count("a") / 200 <= 0.4


class GreedyWindow:
    """A window policy that would wait ten seconds if allowed to."""

    def on_arrival(self, now_ns, tokens): pass
    def on_batch_done(self, size, tokens, compute_ns, now_ns): pass
    def window_ns(self, now_ns, lane): return 10_000 * MS
    def describe(self): return {"policy": "greedy"}


def test_no_window_policy_may_wait_longer_than_the_channels_window_ms():
    s = Scheduler(build_channels({"c": ChannelSettings(max_batch=8, window_ms=150)},
                                 window_policies={"greedy": lambda *a: GreedyWindow()}))
    s.channels["c"].window = GreedyWindow()
    submit_all(s, [item("c", 0)])
    assert s.next_wakeup(0, free_slots=1) == 150 * MS


def test_dispatched_requests_are_not_kept_when_batches_close_by_size():
    s = make(c=ChannelSettings(max_batch=1, window_ms=100))
    for t in range(1000):
        s.submit(item("c", t), t * MS)
        assert len(s.poll(t * MS, free_slots=1).batches) == 1
    assert not s.channels["c"].lanes   # nothing holds on to answered requests (and their payloads)


def test_empty_lanes_are_forgotten_so_a_poll_walks_only_lanes_with_work():
    """10,000 tenants of an isolated channel, each seen once, leave no lane behind: what a poll
    walks stays one lane, however many tenants came before."""
    s = make(c=ChannelSettings(max_batch=8, window_ms=0, isolated=True, queue_limit=20_000))
    lanes = s.channels["c"].lanes
    for t in range(10_000):
        s.submit(item("c", t, deadline_ms=1e9, tenant=f"tenant-{t}"), t * MS)
        assert len(lanes) == 1
        assert len(s.poll(t * MS, free_slots=1).batches) == 1
        assert not lanes
    # Expiry forgets lanes too.
    s.submit(item("c", 20_000, deadline_ms=1, tenant="late"), 20_000 * MS)
    assert len(s.poll(30_000 * MS, free_slots=0).expired) == 1 and not lanes


def learned(s: Scheduler, channel: str, per_item_ms: float, base_ms: float = 0.0) -> None:
    """Teach a channel's cost model a device of base + per_item per batch."""
    for n in (1, 10) * 10:
        s.channels[channel].cost.observe(n, 0, int((base_ms + per_item_ms * n) * MS))


def test_a_backlogged_channel_answers_overloaded_at_once_what_it_cannot_serve_in_time():
    # The device takes 10 ms a request (learned) and is busy; it drains a batch of 10 every
    # 100 ms (100/s); requests arrive every 3 ms (333/s) and may wait 200 ms.
    s = make(c=ChannelSettings(max_batch=10, window_ms=0, deadline_ms=200, queue_limit=10_000))
    learned(s, "c", per_item_ms=10)
    rejected = 0
    for ms in range(3000):
        now = ms * MS
        if ms % 3 == 0 and not s.submit(item("c", ms, deadline_ms=200), now, idle=False):
            rejected += 1
        if ms % 100 == 0:
            s.poll(now, free_slots=1)
    # About 1000 offered, about 300 served: the excess is refused on arrival, as soon as the
    # work queued ahead (10 ms each), its own run and one full batch of slack (100 ms: a request
    # admitted at the very edge ends late at its client) could not be done before its deadline.
    assert rejected >= 600
    assert s.channels["c"].depth <= 20      # what is still queued can be served within 200 ms
    assert 90 * MS <= s.channels["c"].refused_wait_ns <= 110 * MS


def test_never_refused_while_a_device_is_idle_or_before_a_batch_was_timed():
    s = make(c=ChannelSettings(max_batch=10, window_ms=0, deadline_ms=200, queue_limit=10_000))
    assert all(s.submit(item("c", 0, deadline_ms=200), 0, idle=False) for _ in range(500))   # cost unknown
    learned(s, "c", per_item_ms=10)
    assert all(s.submit(item("c", 0, deadline_ms=200), 0, idle=True) for _ in range(100))    # a device idles
    assert not s.submit(item("c", 0, deadline_ms=200), 0, idle=False)


def test_the_work_of_higher_priority_channels_counts_ahead_and_lower_does_not():
    s = make(rt=ChannelSettings(max_batch=10, window_ms=0, deadline_ms=200, priority=2, queue_limit=10_000),
             bulk=ChannelSettings(max_batch=10, window_ms=0, deadline_ms=200, priority=0, queue_limit=10_000))
    learned(s, "rt", per_item_ms=10)
    learned(s, "bulk", per_item_ms=10)
    for _ in range(15):                     # 150 ms of bulk work queued
        assert s.submit(item("bulk", 0, deadline_ms=10_000), 0, idle=False)
    assert s.submit(item("rt", 0, deadline_ms=200), 0, idle=False)       # bulk does not delay realtime
    for _ in range(10):                     # 100 ms of realtime work queued
        s.submit(item("rt", 0, deadline_ms=10_000), 0, idle=False)
    assert not s.submit(item("bulk", 0, deadline_ms=200), 0, idle=False)  # realtime's work is ahead of bulk


def test_a_short_request_is_judged_on_the_work_a_backlog_would_serve_before_it():
    s = make(c=ChannelSettings(max_batch=4, window_ms=0, deadline_ms=10_000, queue_limit=10_000))
    for n, tokens in ((1, 0), (4, 0), (1, 1000), (4, 4000)) * 5:
        s.channels["c"].cost.observe(n, tokens, int((1 * n + 0.1 * tokens) * MS))   # 1 ms each + 0.1 ms/token
    for _ in range(20):
        assert s.submit(item("c", 0, deadline_ms=60_000, tokens=2000), 0, idle=False)   # 20 x 201 ms queued
    assert not s.submit(item("c", 0, deadline_ms=1000, tokens=2000), 0, idle=False)  # behind all of them
    assert s.submit(item("c", 0, deadline_ms=1000, tokens=10), 0, idle=False)        # served before them


def test_a_burst_into_an_idle_channel_is_not_refused():
    s = make(c=ChannelSettings(max_batch=10, window_ms=0, deadline_ms=200, queue_limit=10_000))
    for t in range(20):                 # a quiet start: a few requests, each dispatched at once
        s.submit(item("c", t * 100), t * 100 * MS)
        s.poll(t * 100 * MS, free_slots=1)
    now = 2000 * MS
    assert all(s.submit(item("c", 2000, deadline_ms=200), now) for _ in range(500))


def test_warmup_runs_only_on_an_idle_device_with_no_live_request_and_no_longer_than_a_live_window():
    s = make(live=ChannelSettings(max_batch=8, window_ms=10), bulk=ChannelSettings(max_batch=32, window_ms=50))
    for n in (1, 8, 16) * 10:   # the bulk channel learns 8 ms + 1 ms per request
        s.channels["bulk"].cost.observe(n, 0, (8 + n) * MS)
    warm = [item("bulk", 0, deadline_ms=600_000) for _ in range(20)]
    for it in warm:
        it.warmup = True
    submit_all(s, warm)
    assert s.poll(60 * MS, free_slots=1, device_busy_ns=5 * MS).batches == []   # the device is busy
    submit_all(s, [item("live", 55)])
    assert s.poll(60 * MS, free_slots=1).batches == []                           # a live request waits
    [live] = s.poll(65 * MS, free_slots=1).batches
    assert live.channel == "live"
    [batch] = s.poll(66 * MS, free_slots=1).batches                              # idle, nothing live
    assert batch.channel == "bulk" and all(i.warmup for i in batch.items)
    assert len(batch.items) == 2   # 8 ms + 2 x 1 ms fits the shortest live window (10 ms); a third does not
