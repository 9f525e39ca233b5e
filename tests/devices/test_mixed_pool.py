"""Mixed device pools: a batch goes where it finishes soonest and is cut to that device's size (virtual clock)."""

from __future__ import annotations

from collections import Counter

from dynbatchd.config import ChannelSettings
from dynbatchd.engine.slots import DeviceView, pick_device
from dynbatchd.simulate import COMPLETED, DeviceModel, simulate

MS = 1_000_000
FAST = DeviceModel(base_ms=2.0, per_item_ms=0.1)
SLOW = DeviceModel(base_ms=10.0, per_item_ms=0.5)     # five times slower at every size
CHANNELS = {"std": ChannelSettings(max_batch=8, window_ms=2, deadline_ms=500)}


def test_a_batch_waits_for_the_fast_device_when_it_would_still_finish_there_first():
    # The fast device is busy for 3 ms more and runs the batch in 2 ms: done at 5 ms; the idle slow
    # one would take 10 ms. With the same run time everywhere, the idle device wins.
    views = [DeviceView(held=1, free_at_ns=3 * MS), DeviceView(held=0, free_at_ns=0)]
    assert pick_device(views, 0, inflight=2, lead_ns=3 * MS, run_ns=lambda i: (2, 10)[i] * MS) == 0
    assert pick_device(views, 0, inflight=2, lead_ns=3 * MS, run_ns=lambda i: 2 * MS) == 1


def test_the_fast_device_takes_most_of_the_work_once_the_engine_has_learned_each_devices_speed():
    arrivals = [(i * MS // 2, 0, "std") for i in range(4000)]          # 2000/s for 2 s
    r = simulate(CHANNELS, arrivals, device=[FAST, SLOW])
    items = Counter()
    for b in r.batches:
        items[b.device] += b.size
    assert items[0] > 2 * items[1]                  # the learned 5x shows in the split
    assert all(o == COMPLETED for o in r.outcome)


def test_a_batch_is_cut_to_the_memory_of_the_device_it_goes_to_and_nothing_runs_out_of_memory():
    big, small = DeviceModel(base_ms=2.0, per_item_ms=0.1), DeviceModel(base_ms=2.0, per_item_ms=0.1,
                                                                        memory_items=3, oom_ms=5.0)
    burst = [(0, 10, "std")] * 64                   # more than both can start at once
    sized = simulate(CHANNELS, burst, device=[big, small], size_for_device=True)
    on_small = [b.size for b in sized.batches if b.device == 1]
    assert on_small and max(on_small) <= 3
    assert max(b.size for b in sized.batches if b.device == 0) == 8
    assert not any(b.oom for b in sized.batches)
    assert sorted(sized.outcome) == [COMPLETED] * 64
    # Unsized, the same burst sends the small device batches it cannot hold.
    unsized = simulate(CHANNELS, burst, device=[big, small])
    assert any(b.oom for b in unsized.batches)
