"""Channels and models a reload adds and removes, on the engine against a fake clock: a channel
added is routable at once, one removed refuses new requests and answers everything it holds (queued
or running) exactly once before it leaves the engine and its status; `holds_model` says when a
removed model has nothing left to serve."""

from __future__ import annotations

from dynbatchd import protocol as P
from dynbatchd.config import ChannelSettings
from dynbatchd.engine import OK, Job
from dynbatchd.scheduler import build_channels

from test_engine import MS, Clients, engine, job, ok_outcome


def channel(name: str, **settings):
    settings.setdefault("max_batch", 4)
    settings.setdefault("window_ms", 0)
    settings.setdefault("deadline_ms", 10_000)
    return build_channels({name: ChannelSettings(**settings)})[name]


def test_an_added_channel_takes_requests_at_once():
    e, clients = engine(), Clients()
    e.add_channel(channel("y"))
    assert e.submit(Job("m", "y", 1, 10_000, "y1"), 0) is None
    dispatches, answers = e.step(0)
    clients.take(answers)
    assert [d.batch.channel for d in dispatches] == ["y"]
    clients.take(e.completed(0, dispatches[0].batch.id, ok_outcome(dispatches[0].batch), MS))
    assert clients.codes() == {"y1": OK}
    assert "y" in e.snapshot(MS)["channels"]


def test_a_removed_channel_answers_what_it_holds_then_leaves():
    e, clients = engine(inflight=1, max_batch=2), Clients()
    for i in range(5):   # two batches' worth running and queued, one more waiting
        assert e.submit(job(f"r{i}"), 0) is None
    dispatches, answers = e.step(0)
    clients.take(answers)
    assert len(dispatches) == 1   # one running, three queued
    e.retire_channel("c")
    refused = e.submit(job("late"), MS)
    assert refused.code == P.REFUSED and "removed by a reload" in refused.message
    clients.take([refused])
    now = MS
    while dispatches:   # answer each batch as it comes; the queue drains through the same path
        for d in dispatches:
            now += MS
            clients.take(e.completed(d.device, d.batch.id, ok_outcome(d.batch), now))
        assert "c" in e.channels or not e.busy()
        dispatches, answers = e.step(now)
        clients.take(answers)
    assert clients.codes() == {**{f"r{i}": OK for i in range(5)}, "late": P.REFUSED}
    assert "c" not in e.channels and "c" not in e.snapshot(now)["channels"]


def test_a_channel_added_back_while_draining_keeps_its_queue():
    e, clients = engine(inflight=1, max_batch=1), Clients()
    for i in range(3):
        e.submit(job(f"r{i}"), 0)
    dispatches, _ = e.step(0)
    e.retire_channel("c")
    e.add_channel(channel("c", max_batch=2))
    assert e.submit(job("again"), MS) is None
    assert e.channels["c"].settings.max_batch == 2 and e.channels["c"].depth == 3
    now = MS
    while dispatches:
        for d in dispatches:
            now += MS
            clients.take(e.completed(d.device, d.batch.id, ok_outcome(d.batch), now))
        dispatches, answers = e.step(now)
        clients.take(answers)
    assert set(clients.codes().values()) == {OK} and len(clients.codes()) == 4
    assert "c" in e.channels


def test_holds_model_while_a_request_of_it_is_queued_or_running():
    e, clients = engine(inflight=1, max_batch=1), Clients()
    e.submit(Job("gone", "c", 1, 10_000, "g1"), 0)
    e.submit(Job("gone", "c", 1, 10_000, "g2"), 0)
    assert e.holds_model("gone") and not e.holds_model("other")
    dispatches, _ = e.step(0)
    clients.take(e.completed(0, dispatches[0].batch.id, ok_outcome(dispatches[0].batch), MS))
    assert e.holds_model("gone")   # g2 queued
    dispatches, _ = e.step(MS)
    assert e.holds_model("gone")   # g2 running
    clients.take(e.completed(0, dispatches[0].batch.id, ok_outcome(dispatches[0].batch), 2 * MS))
    assert not e.holds_model("gone")
    assert clients.codes() == {"g1": OK, "g2": OK}


def test_device_limits_are_set_again_per_device():
    e = engine(devices=2)
    e.set_device_limits([(8, 0, "NVML"), (4, 0, "NVML")])
    assert e.device_limits == [(8, 0), (4, 0)] and e.mixed_pool
    assert [d["batch_limit"]["items"] for d in e.snapshot(0)["devices"]] == [8, 4]




def test_removing_the_warmup_channel_drops_the_optional_backlog():
    e = engine(inflight=1, max_batch=1)
    e.add_warmup([Job("m", "c", 1, 0, f"w{i}", cache_key=("m", None, f"w{i}")) for i in range(3)], "c")
    assert e.warmup_backlog
    e.retire_channel("c")
    assert not e.warmup_backlog and e.warmup_channel is None
    e.step(0)   # nothing fed to a channel that is going
