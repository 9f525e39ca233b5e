"""The discrete-event simulator: the real scheduler on a virtual clock (no sleeps, no sockets)."""

from __future__ import annotations

import random

import pytest

from dynbatchd.config import ChannelSettings, PolicySettings
from dynbatchd.plugins import Plugins
from dynbatchd.simulate import (COMPLETED, EXPIRED, FAILED, MS, OVERLOADED, Arrival, DeviceModel,
                                SimulationError, as_arrival, simulate)

DEV = DeviceModel(base_ms=8.0, per_item_ms=0.5)   # 24 ms for a batch of 32


def ch(**kw) -> ChannelSettings:
    kw.setdefault("max_batch", 32)
    kw.setdefault("window_ms", 10)
    return ChannelSettings(**kw)


def mixed_trace(n: int = 3000, rate: float = 1500.0, seed: int = 7) -> list[Arrival]:
    rng = random.Random(seed)
    t, out = 0, []
    for _ in range(n):
        t += int(rng.expovariate(rate) * 1e9)
        out.append(Arrival(t, rng.choice([50, 400, 3000, 12000]), tags=("urgent",) if rng.random() < 0.1 else (),
                           tenant=rng.choice("ab")))
    return out


def test_64_at_once_make_two_full_batches_at_24_and_48_ms():
    r = simulate({"standard": ch()}, [(0, 100, "standard")] * 64, device=DEV)
    # Before it has timed a batch the engine cannot tell when the first will end: it opens the
    # device's queued slot at once, as the live daemon does.
    assert [(b.size, b.formed_ns, b.start_ns, b.end_ns) for b in r.batches] == [
        (32, 0, 0, 24 * MS), (32, 0, 24 * MS, 48 * MS)]
    assert sorted(set(r.latency_ns)) == [24 * MS, 48 * MS]
    assert r.counts()["completed"] == 64
    assert r.utilisation() == 1.0


def test_once_batches_are_timed_the_queued_slot_opens_1_ms_before_the_running_batch_ends():
    second = 1000 * MS
    r = simulate({"standard": ch()}, [(0, 100, "standard")] * 64 + [(second, 100, "standard")] * 64, device=DEV)
    assert [(b.size, b.formed_ns, b.start_ns, b.end_ns) for b in r.batches[2:]] == [
        (32, second, second, second + 24 * MS), (32, second + 23 * MS, second + 24 * MS, second + 48 * MS)]
    total = r.total()
    assert total.p50_ms == 24.0 and total.p99_ms == 48.0


def test_window_expiry_and_per_token_cost_are_exact():
    dev = DeviceModel(base_ms=8.0, per_item_ms=0.5, per_token_ms=0.001)
    r = simulate({"standard": ch(window_ms=10)}, [(0, 1000, "standard"), (2 * MS, 3000, "standard")], device=dev)
    (b,) = r.batches
    # window 10 ms from the oldest arrival; 8 + 0.5·2 + 0.001·4000 = 13 ms of compute
    assert (b.formed_ns, b.end_ns, b.compute_ns) == (10 * MS, 23 * MS, 13 * MS)
    assert r.latency_ns == [23 * MS, 21 * MS]


def test_two_devices_run_in_parallel_and_inflight_queues_on_one():
    both = simulate({"s": ch()}, [(0, 0, "s")] * 64, device=DEV, devices=2, inflight=1)
    assert sorted((b.device, b.end_ns) for b in both.batches) == [(0, 24 * MS), (1, 24 * MS)]
    assert both.utilisation() == 1.0


def test_every_request_is_answered_exactly_once_under_overload_and_expiry():
    channels = {"realtime": ch(max_batch=16, window_ms=30, deadline_ms=200, queue_limit=64, priority=2),
                "standard": ch(max_batch=32, window_ms=100, deadline_ms=1000, queue_limit=256, priority=1),
                "bulk": ch(max_batch=8, window_ms=500, deadline_ms=30000, queue_limit=128, min_share=0.05)}
    # [routing] as a file has it: the core's default, the routing plugin's rules
    routing = {"default": "standard", "rules": [{"channel": "bulk", "tokens_above": 8192},
                                                {"channel": "realtime", "tag": "urgent"}]}
    trace = mixed_trace()
    r = simulate(channels, trace, device=DeviceModel(per_token_ms=0.002), routing=routing)
    counts = r.counts()
    assert sum(counts.values()) == len(trace)
    assert counts["overloaded"] > 0 and counts["deadline_exceeded"] > 0 and counts["completed"] > 0
    assert all(o in (COMPLETED, EXPIRED, OVERLOADED) for o in r.outcome)
    # Every completed request left in exactly one batch.
    assert sum(b.size for b in r.batches) == counts["completed"]
    # Routing as the daemon's rules do it.
    for a, name in zip(r.arrivals, r.channel_of):
        assert name == ("bulk" if a.tokens > 8192 else "realtime" if "urgent" in a.tags else "standard")
    # The scheduler's own stats agree with the simulator's answers.
    snap = r.snapshot
    assert sum(s["completed"] for s in snap.values()) == counts["completed"]
    assert sum(s["expired"] for s in snap.values()) == counts["deadline_exceeded"]
    assert sum(s["rejected"]["overloaded"] for s in snap.values()) == counts["overloaded"]


def test_full_queue_answers_overloaded_at_once():
    r = simulate({"s": ch(queue_limit=10, max_batch=4, window_ms=50)}, [(0, 0, "s")] * 25, device=DEV)
    assert list(r.outcome).count(OVERLOADED) == 15
    assert all(r.latency_ns[i] == 0 for i, o in enumerate(r.outcome) if o == OVERLOADED)
    assert r.stats()["s"].overloaded == 15 and r.stats()["s"].completed == 10


def test_hopeless_requests_are_answered_deadline_exceeded():
    # Batches of 4 take 10 ms on one slot; deadline 19 ms. A cost learned from one batch is too
    # young to refuse work on (CostModel.trusted), so the second batch still runs (1 ms late);
    # everything else is answered the instant its deadline passes, not run late.
    r = simulate({"s": ch(max_batch=4, window_ms=0, deadline_ms=19)}, [(0, 0, "s")] * 100,
                 device=DEV, inflight=1)
    assert list(r.outcome).count(COMPLETED) == 8
    assert list(r.outcome).count(EXPIRED) == 92
    assert {r.latency_ns[i] for i, o in enumerate(r.outcome) if o == EXPIRED} == {19 * MS + 1}
    s = r.stats()["s"]
    assert (s.on_time, s.expired, s.late) == (4, 92, 4)
    assert s.on_time_fraction == pytest.approx(0.04)


def test_a_settled_cost_answers_hopeless_requests_before_their_deadline():
    # 40 batches of 4 teach the cost (10 ms a batch); at 395 ms, while the last of them runs
    # until 400 ms, 4 requests with an 8 ms deadline arrive: none can end in time, and the
    # settled, just-confirmed cost answers them at once instead of at their deadline.
    warm = [(0, 0, "s")] * 160
    hopeless = [Arrival(int(395 * MS), 0, "s", deadline_ms=8)] * 4
    r = simulate({"s": ch(max_batch=4, window_ms=0, deadline_ms=1000)}, warm + hopeless, device=DEV, inflight=1)
    assert list(r.outcome).count(COMPLETED) == 160
    assert list(r.outcome[160:]) == [EXPIRED] * 4
    assert set(r.latency_ns[160:]) == {0}


def test_isolated_channel_never_mixes_tenants_in_a_batch():
    trace = [Arrival(k * 100_000, 10, tenant="bank-a" if k % 2 else "bank-b") for k in range(400)]
    iso = simulate({"s": ch(isolated=True)}, trace, device=DEV)
    assert iso.counts()["completed"] == 400
    assert all(len(b.tenants) == 1 for b in iso.batches)
    shared = simulate({"s": ch(isolated=False)}, trace, device=DEV)
    assert any(len(b.tenants) == 2 for b in shared.batches)


def test_out_of_memory_splits_retries_and_lowers_the_limit():
    dev = DeviceModel(base_ms=8.0, per_item_ms=0.5, memory_items=8)
    r = simulate({"s": ch(max_batch=32, window_ms=0)}, [(0, 0, "s")] * 64, device=dev)
    assert r.counts()["completed"] == 64
    first, second = r.batches
    # 32 does not fit; the halves of 16 neither; four batches of 8 do: 4 × 12 ms.
    assert first.oom and first.compute_ns == 48 * MS and first.end_ns == 48 * MS
    assert second.oom and second.end_ns == 96 * MS
    assert r.snapshot["s"]["max_batch"] == 16   # the sizer halved the channel's limit


def test_a_single_request_that_cannot_fit_fails_alone():
    dev = DeviceModel(memory_tokens=1000)
    r = simulate({"s": ch(window_ms=5)}, [(0, 100, "s"), (0, 5000, "s"), (0, 200, "s")], device=dev)
    assert list(r.outcome) == [COMPLETED, FAILED, COMPLETED]
    assert r.counts()["model_error"] == 1


def test_arrival_tuples_take_a_channel_or_metadata():
    assert as_arrival((5, 10, "bulk")) == Arrival(5, 10, "bulk")
    a = as_arrival((5, 10, {"tags": ["urgent"], "tenant": "t", "slo_ms": 50}))
    assert a.tags == ("urgent",) and a.tenant == "t" and a.slo_ms == 50 and a.channel is None


def test_slo_separate_from_deadline_counts_late_completions():
    # deadline 30 s (nothing expires, FIFO), but the class's SLO is 20 ms
    r = simulate({"fifo": ch(deadline_ms=30000)},
                 [(0, 0, {"channel": "fifo", "slo_ms": 30, "label": "realtime"})] * 64, device=DEV)
    s = r.stats()["realtime"]
    assert (s.on_time, s.late) == (32, 32)


def test_runs_are_deterministic():
    channels = {"s": ch(max_batch=16, window_ms=20, deadline_ms=300)}
    a = simulate(channels, mixed_trace(1500), device=DEV)
    b = simulate(channels, mixed_trace(1500), device=DEV)
    assert a.latency_ns == b.latency_ns and list(a.outcome) == list(b.outcome)


def test_utilisation_over_a_window():
    r = simulate({"s": ch()}, [(0, 0, "s")] * 32, device=DEV)
    assert r.utilisation(0, 48 * MS) == pytest.approx(0.5)


def test_answering_twice_is_caught(monkeypatch):
    from dynbatchd.scheduler import Scheduler

    real_poll = Scheduler.poll

    def poll_twice(self, now_ns, free_slots, *args):
        decision = real_poll(self, now_ns, free_slots, *args)
        decision.expired.extend(item for b in decision.batches for item in b.items)
        return decision
    monkeypatch.setattr(Scheduler, "poll", poll_twice)
    with pytest.raises(SimulationError):
        simulate({"s": ch()}, [(0, 0, "s")] * 4, device=DEV)


def _registered():
    plugins = Plugins.load()
    return plugins, plugins.window_policies(), plugins.batch_sizers()


@pytest.mark.parametrize("kind", ["window", "sizer"])
def test_every_registered_policy_answers_everything(kind):
    plugins, windows, sizers = _registered()
    names = windows if kind == "window" else sizers
    trace = mixed_trace(1500, rate=1200)
    for name in names:
        sel = PolicySettings(policy=name)
        settings = ch(max_batch=32, window_ms=50, deadline_ms=500,
                      **({"window": sel} if kind == "window" else {"batch_size": sel}))
        r = simulate({"s": settings}, trace, device=DEV, window_policies=windows, sizers=sizers)
        assert sum(r.counts().values()) == len(trace), name
        assert r.counts()["completed"] > 0, name


def test_the_daemon_sends_a_batch_to_the_device_free_first_and_only_when_it_is_due():
    # Device 0 runs 20 items (0-18 ms), device 1 four (1-11 ms). A third batch is due at 2 ms.
    # Queued on device 0 it would wait behind the long batch; the engine waits until a device is
    # about to free (10 ms, 1 ms lead) and sends it to device 1. A first wave, a second earlier,
    # teaches the cost model (sizes 20 and 4 fit the line exactly), as live traffic would.
    ch1 = {"s": ch(max_batch=20, window_ms=0)}
    wave = [(0, 0, "s")] * 20 + [(1 * MS, 0, "s")] * 4 + [(2 * MS, 0, "s")]
    at = 1000 * MS
    trace = wave + [(t + at, k, c) for t, k, c in wave]
    daemon = simulate(ch1, trace, device=DEV, devices=2, inflight=2)
    four, twenty, last = sorted(daemon.batches[3:], key=lambda b: b.formed_ns if b.size != 4 else -1)
    assert (four.size, four.start_ns - at, four.end_ns - at) == (4, 1 * MS, 11 * MS)
    assert (twenty.size, twenty.start_ns - at, twenty.end_ns - at) == (20, 0, 18 * MS)
    assert four.device != twenty.device and last.device == four.device   # the one that frees first
    assert (last.formed_ns - at, last.start_ns - at, last.end_ns - at) == (10 * MS, 11 * MS, 19.5 * MS)


# -- the benchmark traces ------------------------------------------------------

def _traces():
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks import traces
    return traces


def test_phased_trace_has_three_phases_with_the_guides_mix():
    traces = _traces()
    t = traces.phased(seconds=(2.0, 1.0, 2.0), seed=3)
    assert [p[0] for p in t.phases] == ["steady-low", "burst", "steady-medium"]
    rates = [sum(1 for a in t.arrivals if lo <= a.at_ns < hi) / ((hi - lo) / 1e9) for _, lo, hi in t.phases]
    assert rates[1] == pytest.approx(4 * rates[0], rel=0.15) and rates[2] == pytest.approx(2 * rates[0], rel=0.15)
    short = sum(a.tokens <= 512 for a in t.arrivals) / len(t.arrivals)
    long_ = sum(a.tokens > 2048 for a in t.arrivals) / len(t.arrivals)
    assert short == pytest.approx(0.7, abs=0.03) and long_ == pytest.approx(0.1, abs=0.02)
    assert traces.phased(seconds=(2.0, 1.0, 2.0), seed=3).arrivals == t.arrivals   # deterministic


def test_k12_trace_is_95_percent_short_and_labels_the_guides_routing():
    traces = _traces()
    t = traces.k12_surge(surge_s=4.0, before_s=2.0, after_s=2.0)
    long_ = [a for a in t.arrivals if a.tokens > 10_000]
    assert len(long_) / len(t.arrivals) == pytest.approx(0.05, abs=0.01)
    assert all(a.label == "bulk" for a in long_)
    assert all(a.label == "realtime" for a in t.arrivals if "urgent" in a.tags)
    assert all(a.tokens < 512 for a in t.arrivals if a.label != "bulk")
    lo, hi = t.phase("surge")
    before = t.phase("before")
    surge_rate = sum(lo <= a.at_ns < hi for a in t.arrivals) / ((hi - lo) / 1e9)
    base_rate = sum(before[0] <= a.at_ns < before[1] for a in t.arrivals) / ((before[1] - before[0]) / 1e9)
    assert surge_rate == pytest.approx(4 * base_rate, rel=0.15)


def test_azure_trace_loads_compressed_or_skips():
    traces = _traces()
    if not traces.azure_available():
        pytest.skip(f"{traces.AZURE_CSV} not present")
    t = traces.azure_conv(compress=60.0, start_s=1200.0, span_s=120.0)
    assert t.arrivals and all(0 <= a.at_ns < 2_000_000_000 for a in t.arrivals)
    assert len(t.phases) == 2 and all(a.tokens >= 1 for a in t.arrivals)
    assert [a.at_ns for a in t.arrivals] == sorted(a.at_ns for a in t.arrivals)


def test_batch_sizers_are_fed_once_a_simulated_second_like_the_daemon():
    seen = []

    class Spy:
        def max_batch(self):
            return 32

        def observe(self, *, utilisation, memory, queue_len, now_ns):
            seen.append((now_ns, round(utilisation, 6), round(memory, 6), queue_len))

        def on_oom(self, failed_size):
            pass

        def describe(self):
            return {"policy": "spy"}

    dev = DeviceModel(base_ms=8.0, per_item_ms=0.5, memory_items=64)
    settings = ch(batch_size=PolicySettings(policy="spy"))
    trace = [(0, 0, "s")] * 64 + [(int(1.5e9), 0, "s")]
    simulate({"s": settings}, trace, device=dev, sizers={"spy": lambda name, s, o: Spy()})
    # 48 ms of compute in the first second; the fullest batch used 32/64 of the memory limit.
    assert seen == [(1_000_000_000, 0.048, 0.5, 0)]


def test_failed_attempts_cost_device_time_as_the_worker_pays_them():
    # 16 items, room for 8, each failed attempt wastes 2 ms: the worker tries 16 (fails), then
    # goes straight to the halves: 8 + 8 = 2 × 12 ms.
    dev = DeviceModel(base_ms=8.0, per_item_ms=0.5, memory_items=8, oom_ms=2.0)
    r = simulate({"s": ch(max_batch=16, window_ms=0)}, [(0, 0, "s")] * 16, device=dev)
    (b,) = r.batches
    assert b.oom and b.compute_ns == (2 + 12 + 12) * MS


def test_a_mixed_pool_learns_each_device_and_sends_a_batch_where_it_finishes_soonest():
    fast, slow = DeviceModel(base_ms=4.0, per_item_ms=0.25), DeviceModel(base_ms=12.0, per_item_ms=0.75)
    rng = random.Random(2)
    trace, t = [], 0
    for _ in range(3000):
        t += int(rng.expovariate(600) * 1e9)   # about 60% of what the pair can do
        trace.append((t, 0, "s"))
    r = simulate({"s": ch(max_batch=32, window_ms=5, deadline_ms=1000)}, trace, device=[slow, fast])
    work = [sum(b.size for b in r.batches if b.device == d) for d in (0, 1)]
    assert work[1] > 1.5 * work[0]                 # the fast device (index 1) takes most of the work
    lone = [b for b in r.batches[100:] if b.start_ns == b.formed_ns and
            not any(o.device != b.device and o.start_ns <= b.formed_ns < o.end_ns for o in r.batches)]
    assert lone and all(b.device == 1 for b in lone)   # with both idle, the batch goes to the fast one
    assert r.counts()["completed"] == 3000
