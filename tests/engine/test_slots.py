"""Device slots: when a new batch may be cut, and which device takes it (pure, exact times)."""

from __future__ import annotations

from dynbatchd.devices.pool import detect_devices
from dynbatchd.engine.slots import DeviceView, estimated_free_at, next_opening_ns, open_slots, pick_device

MS = 1_000_000
LEAD = 1 * MS


def test_an_idle_device_opens_one_slot_at_a_time():
    assert open_slots([DeviceView(0, 0)], 5 * MS, inflight=2, lead_ns=LEAD) == (1, 0)


def test_a_busy_device_queues_the_next_batch_only_just_before_it_frees():
    busy = [DeviceView(1, 20 * MS)]
    assert open_slots(busy, 10 * MS, 2, LEAD) == (0, 0)
    assert next_opening_ns(busy, 10 * MS, 2, LEAD) == 19 * MS
    assert open_slots(busy, 19 * MS, 2, LEAD) == (1, 1 * MS)   # may cut now; it can start in 1 ms


def test_a_full_or_unusable_device_takes_nothing():
    assert open_slots([DeviceView(2, 0), DeviceView(0, 0, usable=False)], 0, 2, LEAD) == (0, 0)
    assert pick_device([DeviceView(2, 0), DeviceView(0, 0, usable=False)], 0, 2, LEAD) is None
    assert next_opening_ns([DeviceView(2, 30 * MS)], 0, 2, LEAD) is None


def test_the_batch_goes_to_the_device_that_can_start_it_soonest():
    devices = [DeviceView(1, 18 * MS), DeviceView(1, 10 * MS), DeviceView(0, 0)]
    assert pick_device(devices, 9 * MS, 2, LEAD) == 2            # the idle one
    devices[2] = DeviceView(2, 40 * MS)
    assert pick_device(devices, 9 * MS, 2, LEAD) == 1            # device 1 frees at 10 ms, device 0 at 18
    assert pick_device(devices, 17 * MS, 2, LEAD) == 1


def test_held_batches_run_in_the_order_sent():
    held = [("a", 0), ("b", 2 * MS)]
    assert estimated_free_at(held, {"a": 10 * MS, "b": 5 * MS}.get) == 15 * MS
    assert estimated_free_at([("a", 30 * MS)], {"a": 10 * MS}.get) == 40 * MS


def test_auto_devices_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert detect_devices("auto") == ["cuda:0", "cuda:1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert detect_devices("auto") == ["cpu"]
    assert detect_devices(["cpu", "cuda:1"]) == ["cpu", "cuda:1"]


def test_latency_recent_window_forgets_old_periods_but_lifetime_keeps_them():
    from dynbatchd.telemetry import LatencyRecorder

    rec = LatencyRecorder()
    for _ in range(100):
        rec.record(1_000_000)          # a bad minute: 1 s each
    rec.rotate()
    rec.rotate()                       # two periods later it is out of the recent window
    for _ in range(100):
        rec.record(1_000)              # now: 1 ms each
    assert rec.recent().quantile(0.99) <= 1_100
    assert rec.lifetime.quantile(0.99) >= 900_000
    assert rec.lifetime.cumulative()[-1][1] == 200 and rec.lifetime.total == 200


def test_recording_a_batch_of_latencies_at_once_is_recording_each():
    from dynbatchd.telemetry import Histogram

    values = [0, 1, 2, 999, 1_000, 12_345, 10**12]   # the bottom bucket, the edges, past the top
    one_by_one, at_once = Histogram(), Histogram()
    for us in values:
        one_by_one.record(us)
    at_once.record_all(values)
    at_once.record_all([])
    assert at_once.counts == one_by_one.counts
    assert (at_once.total, at_once.sum_us, at_once.max_us) == (one_by_one.total, one_by_one.sum_us, one_by_one.max_us)


def test_health_score_normalises_each_term_before_weighting():
    from dynbatchd.telemetry import daemon_health, health_score

    # The guide adds raw QPS, 1/P99, utilisation and headroom; normalised, a perfect daemon scores 1.
    assert health_score(1.0, 1.0, 50.0, 100.0, 1.0, 1.0) == 1.0
    # p99 at twice the deadline halves the p99 term: 0.4 + 0.3 * 0.5 + 0.2 * 0.5 + 0.1 * 1.
    channels = {"rt": {"on_time_count": 98, "offered": 100, "p99_ms": 400.0},
                "std": {"on_time_count": 100, "offered": 100, "p99_ms": 100.0}}
    h = daemon_health(channels, {"rt": 200.0, "std": 1000.0}, [{"busy_fraction": 0.5}], memory_used=0.0)
    assert h["on_time"] == 0.99 and h["p99_over_deadline"] == 2.0
    assert h["score"] == round(0.4 * 0.99 + 0.3 * 0.5 + 0.2 * 0.5 + 0.1 * 1.0, 4)


def test_a_device_whose_feeder_prepares_for_8_ms_opens_its_queued_slot_8_ms_early():
    # A pipelined worker tokenises the next batch while one runs: it must get it that early.
    plain = DeviceView(held=1, free_at_ns=100 * MS)
    pipelined = DeviceView(held=1, free_at_ns=100 * MS, lead_ns=8 * MS)
    assert open_slots([plain], 91 * MS, inflight=2, lead_ns=1 * MS) == (0, 0)
    assert open_slots([pipelined], 91 * MS, inflight=2, lead_ns=1 * MS) == (0, 0)
    assert open_slots([pipelined], 92 * MS, inflight=2, lead_ns=1 * MS) == (1, 8 * MS)
    assert next_opening_ns([plain], 0, inflight=2, lead_ns=1 * MS) == 99 * MS
    assert next_opening_ns([pipelined], 0, inflight=2, lead_ns=1 * MS) == 92 * MS


def test_a_device_still_holding_a_batch_past_its_estimate_is_not_idle():
    # A batch whose cost was never learned (a rare bulk batch estimated at nothing) may still run
    # long after its estimated end: the device may queue the next batch, but it cannot start it
    # at once, so the scheduler is never told a device idles (a planned channel's window would
    # then stop holding for it, and its batch wait seconds behind the bulk one).
    overdue = [DeviceView(1, 5 * MS)]
    assert open_slots(overdue, 10 * MS, 2, LEAD) == (1, 1)
    assert open_slots(overdue + [DeviceView(0, 0)], 10 * MS, 2, LEAD) == (2, 0)   # an idle one beside it
