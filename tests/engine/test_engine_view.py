"""The engine's read model (issue 25): what the daemon asks of the engine instead of reaching
into its device table, and the memory figure the observer reports through observe()."""

from __future__ import annotations

from dynbatchd.config import ChannelSettings
from dynbatchd.engine import Engine, Job, Outcome
from dynbatchd.scheduler import build_channels

MS = 1_000_000


def engine() -> Engine:
    e = Engine(build_channels({"c": ChannelSettings(max_batch=2, window_ms=0, deadline_ms=100)}), ["d0", "d1"],
               feeders=2)
    e.device_up(0)
    return e


def test_the_read_model_follows_a_batch_from_queue_to_answer():
    e = engine()
    for i in range(3):
        e.submit(Job("m", "c", 1, 100, i), 0)
    assert e.queued() == 3 and e.batches_in_flight() == 0
    dispatches, _ = e.step(0)
    first = dispatches[0]
    assert e.held_batch(first.device, first.batch.id) is first.batch
    assert e.batches_in_flight() == len(dispatches) and e.queued() == 3 - sum(len(d.batch.items) for d in dispatches)
    e.completed(first.device, first.batch.id, Outcome(MS, [0] * len(first.batch.items)), MS)
    assert e.held_batch(first.device, first.batch.id) is None   # a late duplicate result finds nothing
    assert e.held_batch(1, 12345) is None


def test_every_device_gone_only_when_the_last_one_is():
    e = engine()
    e.device_gone(1, 0)
    assert not e.every_device_gone()
    e.device_gone(0, 0)
    assert e.every_device_gone()
    e.device_up(1)
    assert not e.every_device_gone()


def test_batch_memory_and_the_health_memory_are_reported_not_written():
    e = engine()
    e.note_batch_memory(0, 1, 4096)
    assert e.devices[0].stats.batch_memory == {1: 4096}
    e.observe(0, 0.5, 0.2)
    assert e.memory_used == 0.0   # not given: left as it was
    e.observe(MS, 0.5, 0.2, memory_used=0.75)
    assert e.memory_used == 0.75
