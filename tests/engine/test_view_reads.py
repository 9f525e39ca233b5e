"""The engine's read model for status, metrics and the observer, and its commands for what drivers
used to write (issue 25): each read is a copy or a read-only view, and a write goes through a
command. (tests/project/test_engine_state.py checks that nothing outside the engine reaches in.)"""

from __future__ import annotations

import pytest

from dynbatchd.config import ChannelSettings
from dynbatchd.engine import Engine, Job, Outcome
from dynbatchd.scheduler import build_channels

MS = 1_000_000


def engine() -> Engine:
    e = Engine(build_channels({"c": ChannelSettings(max_batch=2, window_ms=0, deadline_ms=100),
                               "d": ChannelSettings(max_batch=2, window_ms=0, deadline_ms=250)}), ["d0", "d1"])
    e.device_up(0)
    e.device_up(1)
    return e


class Judge:
    """A canary judge that never decides (the split stays running)."""
    duration_ns = 10 * MS

    def takes_next(self):
        return False

    def decide(self, now_ns):
        return None

    def record(self, *args):
        pass

    def record_batch(self, *args):
        pass


def test_status_reads_come_from_the_snapshot():
    e = engine()
    e.observe(0, 0.5, 0.2, memory_used=0.75)
    snap = e.snapshot(0)
    assert snap["deadlines_ms"] == {"c": 100, "d": 250} and snap["memory_used"] == 0.75
    assert snap["polls"] == 0 and snap["warmup_backlog"] == 0


def test_lifetime_latencies_are_copies_per_channel():
    e = engine()
    e.submit(Job("m", "c", 1, 100, "a"), 0)
    (dispatch,), _ = e.step(0)
    e.completed(dispatch.device, dispatch.batch.id, Outcome(MS, [0]), 3 * MS)
    lifetimes = e.latency_lifetimes()
    assert set(lifetimes) == {"c", "d"} and lifetimes["c"].total == 1 and lifetimes["d"].total == 0
    lifetimes["c"].record(1)   # the caller's copy: the engine's own is untouched
    assert e.latency_lifetimes()["c"].total == 1


def test_splits_running_is_a_read_only_view():
    e = engine()
    assert dict(e.splits_running()) == {}
    twin = build_channels({"c~canary": ChannelSettings(max_batch=4, window_ms=0, deadline_ms=100)})["c~canary"]
    split = e.start_split("c", twin, Judge())
    running = e.splits_running()
    assert running["c"] is split and e.has_channel("c~canary") and not e.has_channel("x")
    with pytest.raises(TypeError):
        running["d"] = split   # type: ignore[index]
    e.end_split("c", "stopped")
    assert "c" not in running   # a view: it follows the engine


def test_device_usage_copies_what_the_observer_needs():
    e = engine()
    e.note_batch_memory(1, 0, 4096)
    e.submit(Job("m", "c", 1, 100, "a"), 0)
    (dispatch,), _ = e.step(0)
    e.completed(dispatch.device, dispatch.batch.id, Outcome(2 * MS, [0]), 3 * MS)
    usage = e.device_usage()
    assert [u.name for u in usage] == ["d0", "d1"] and usage[dispatch.device].busy_ns == 2 * MS
    assert usage[1].batch_memory == {0: 4096}
    usage[1].batch_memory[0] = 1   # a copy
    assert e.device_usage()[1].batch_memory == {0: 4096}


def test_warmup_waiting_counts_the_backlog():
    e = engine()
    e.device_gone(0, 0)
    e.device_gone(1, 0)   # nowhere to run: the warmup waits in the backlog
    queued, cached = e.add_warmup([Job("m", "c", 1, 0, i) for i in range(3)], "c")
    assert (queued, cached) == (3, 0) and e.warmup_waiting() == 3


def test_generate_requests_count_through_a_command():
    e = engine()
    e.count_generated("c", "accepted")
    e.count_generated("c", "completed", late=True)
    e.count_generated("gone", "completed")   # a channel the engine no longer runs: nothing
    stats = e.snapshot(0)["channels"]["c"]
    assert (stats["accepted"], stats["completed"], stats["late"]) == (1, 1, 1)
    with pytest.raises(ValueError):
        e.count_generated("c", "batches")   # only a generate request's own counters
