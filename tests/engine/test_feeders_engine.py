"""Several feeders (worker processes) on one device, against a fake clock.

The engine sees one device; each batch goes to its least-loaded feeder that is
up, and a feeder that dies costs only its own batches while the others serve.
"""

from __future__ import annotations

from test_engine import MS, Clients, engine, job, ok_outcome

from dynbatchd import protocol as P
from dynbatchd.engine import OK
from dynbatchd.engine.slots import DeviceView, open_slots


def finish(e, clients, dispatches, now):
    for d in dispatches:
        clients.take(e.completed(d.device, d.batch.id, ok_outcome(d.batch), now))


def test_every_feeder_gets_a_batch_at_once_and_one_more_waits_behind_them():
    e = engine(feeders=2, inflight=2)
    for i in range(16):
        e.submit(job(i), 0)
    dispatches, _ = e.step(0)
    # two feeders + inflight - 1: a batch each, and one queued on the least loaded (the first on a tie)
    assert [(d.device, d.feeder, len(d.batch.items)) for d in dispatches] == [(0, 0, 4), (0, 1, 4), (0, 0, 4)]
    assert e.snapshot(0)["devices"][0]["inflight"] == 3


def test_an_idle_feeder_opens_a_slot_at_once_while_the_device_is_busy():
    """The device runs one batch at a time (free at 20 ms), but a second feeder with nothing to
    do may take a batch now, to prepare it meanwhile; a third batch waits for the lead."""
    busy = DeviceView(held=1, free_at_ns=20 * MS, feeders=2)
    assert open_slots([busy], 0, inflight=2, lead_ns=MS) == (1, 20 * MS)   # it can start in 20 ms
    full = DeviceView(held=2, free_at_ns=30 * MS, feeders=2)
    assert open_slots([full], 0, inflight=2, lead_ns=MS) == (0, 0)
    assert open_slots([full], 29 * MS, inflight=2, lead_ns=MS) == (1, MS)
    assert open_slots([DeviceView(3, 30 * MS, feeders=2)], 29 * MS, inflight=2, lead_ns=MS) == (0, 0)


def test_a_lost_feeder_costs_only_its_own_batch_while_the_others_keep_running():
    e, clients = engine(feeders=3, inflight=1), Clients()
    for i in range(12):
        e.submit(job(i), 0)
    dispatches, _ = e.step(0)
    assert [d.feeder for d in dispatches] == [0, 1, 2]
    lost = next(d for d in dispatches if d.feeder == 1)
    loss = e.lost(0, MS, feeder=1)
    assert loss.answers == [] and not loss.explained
    device = e.devices[0]
    assert device.usable and not device.gone                      # two feeders are still up
    assert set(device.held) == {d.batch.id for d in dispatches if d.feeder != 1}
    assert e.submit(job("later"), MS) is None                     # not refused: the device serves
    finish(e, clients, [d for d in dispatches if d.feeder != 1], 2 * MS)
    # The lost batch's requests run again, each alone (on an idle device), on the feeders that are up.
    payloads = {item.payload for item in lost.batch.items}
    for _ in range(50):
        dispatches, answers = e.step(3 * MS)
        clients.take(answers)
        if not dispatches:
            break
        assert all(d.feeder != 1 for d in dispatches)
        for d in dispatches:
            if payloads & {item.payload for item in d.batch.items}:
                assert len(d.batch.items) == 1
        finish(e, clients, dispatches, 3 * MS)
    assert clients.codes() == {**{i: OK for i in range(12)}, "later": OK}


def test_the_device_is_unusable_only_when_no_feeder_is_up():
    e = engine(feeders=2)
    e.lost(0, 0, feeder=0)
    assert e.devices[0].usable
    e.lost(0, 0, feeder=1)
    assert not e.devices[0].usable and not e.devices[0].gone
    e.submit(job("waits"), 0)
    assert e.step(0)[0] == []                                     # nothing to send it to
    e.device_up(0, 1)
    [d], _ = e.step(MS)
    assert d.feeder == 1


def test_a_batch_that_could_not_be_sent_downs_only_its_feeder():
    e = engine(feeders=2, inflight=1)
    for i in range(8):
        e.submit(job(i), 0)
    dispatches, _ = e.step(0)
    e.undelivered(0, dispatches[1].batch.id)
    assert e.devices[0].up == [True, False] and e.devices[0].usable
    assert e.scheduler.depth() == 4                               # back in the queue, as it was


def test_the_watchdog_names_the_feeder_that_holds_the_hung_batch():
    e, clients = engine(feeders=2, inflight=1), Clients()
    for i in range(8):
        e.submit(job(i), 0)
    first, second = e.step(0)[0]
    finish(e, clients, [first], 5 * MS)          # feeder 0 answers; feeder 1 hangs
    timeout = 100 * MS
    assert e.overdue(timeout, timeout) == []
    assert e.overdue(timeout + 1, timeout) == [(0, 1, timeout)]
    loss = e.lost(0, timeout + 2, feeder=1)      # the observer killed it: its batch reruns, each alone
    assert loss.answers == [] and e.devices[0].usable
    for _ in range(20):
        dispatches, answers = e.step(timeout + 3)
        clients.take(answers)
        if not dispatches:
            break
        finish(e, clients, dispatches, timeout + 3)
    assert clients.codes() == {i: OK for i in range(8)}


def test_a_poison_input_is_proven_on_a_second_feeder_and_the_device_never_goes_down():
    e, clients = engine(feeders=2), Clients()
    for payload in ("a", "poison", "b"):
        e.submit(job(payload), 0)
    [first], _ = e.step(0)
    assert not e.lost(0, MS, feeder=first.feeder).explained
    for _ in range(10):
        dispatches, answers = e.step(2 * MS)
        clients.take(answers)
        if not dispatches:
            break
        for d in dispatches:
            assert len(d.batch.items) == 1 and d.feeder != first.feeder   # the dead one is not back yet
            if d.batch.items[0].payload == "poison":
                loss = e.lost(0, 3 * MS, feeder=d.feeder)
                assert loss.explained
                clients.take(loss.answers)
                e.device_up(0, d.feeder)
            else:
                clients.take(e.completed(0, d.batch.id, ok_outcome(d.batch), 3 * MS))
        assert e.devices[0].usable or not any(e.devices[0].up)
    assert clients.codes() == {"a": OK, "b": OK, "poison": P.MODEL_ERROR}
