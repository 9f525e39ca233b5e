"""The engine against a fake clock: what only the daemon's end-to-end tests covered before.

Every test drives `Engine` by hand, playing the part of the sockets and the
workers, and checks that each accepted request is answered exactly once.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dynbatchd import protocol as P
from dynbatchd.cache import ResultCache
from dynbatchd.config import ChannelSettings
from dynbatchd.engine import OK, Engine, Job, Outcome
from dynbatchd.scheduler import build_channels

MS = 1_000_000
REPO = Path(__file__).resolve().parents[2]


class Clients:
    """Records every answer by payload and fails on a second one for the same request."""

    def __init__(self) -> None:
        self.answers: dict[object, tuple[str, object]] = {}

    def take(self, answers) -> None:
        for a in answers:
            assert a.payload not in self.answers, f"{a.payload} answered twice"
            self.answers[a.payload] = (a.code, a.output)

    def codes(self) -> dict[object, str]:
        return {k: code for k, (code, _) in self.answers.items()}


def engine(devices: int = 1, *, cache: ResultCache | None = None, inflight: int = 2, feeders: int = 1,
           **settings) -> Engine:
    settings.setdefault("max_batch", 4)
    settings.setdefault("window_ms", 0)
    settings.setdefault("deadline_ms", 10_000)
    e = Engine(build_channels({"c": ChannelSettings(**settings)}), [f"d{i}" for i in range(devices)],
               inflight=inflight, feeders=feeders, cache=cache, fingerprint=lambda payload: str(payload).split("#")[0])
    for i in range(devices):
        for f in range(feeders):
            e.device_up(i, f)
    return e


def job(payload, *, tenant=None, cache_key=None) -> Job:
    return Job("m", "c", 1, 10_000, payload, tenant, cache_key)


def ok_outcome(batch, compute_ns=MS) -> Outcome:
    return Outcome(compute_ns, [f"out:{item.payload}" for item in batch.items])


def run_all(e: Engine, clients: Clients, now: int) -> None:
    """Step and complete every dispatched batch successfully until nothing is left."""
    while True:
        dispatches, answers = e.step(now)
        clients.take(answers)
        if not dispatches:
            return
        for d in dispatches:
            clients.take(e.completed(d.device, d.batch.id, ok_outcome(d.batch), now))


def test_a_batch_runs_and_every_request_gets_its_own_answer():
    e, clients = engine(), Clients()
    for i in range(6):
        assert e.submit(job(i), 0) is None
    run_all(e, clients, 0)
    assert clients.answers == {i: (OK, f"out:{i}") for i in range(6)}
    assert e.snapshot(0)["channels"]["c"]["completed"] == 6


def test_a_death_retries_the_running_batch_alone_and_requeues_the_waiting_one():
    e, clients = engine(), Clients()
    for i in range(8):
        e.submit(job(i), 0)
    dispatches, _ = e.step(0)
    assert [len(d.batch.items) for d in dispatches] == [4, 4]   # one running, one queued behind it
    loss = e.lost(0, 1 * MS)
    assert loss.answers == [] and not loss.explained
    e.device_up(0)
    sizes = []
    for _ in range(20):
        dispatches, answers = e.step(2 * MS)
        clients.take(answers)
        if not dispatches:
            break
        for d in dispatches:
            sizes.append(len(d.batch.items))
            clients.take(e.completed(d.device, d.batch.id, ok_outcome(d.batch), 2 * MS))
    assert sizes[:4] == [1, 1, 1, 1]   # the four that were running go one at a time, alone
    assert 4 in sizes[4:]              # the waiting batch goes as it was
    assert clients.codes() == {i: OK for i in range(8)}


def test_a_poison_input_is_proven_by_a_second_death_quarantined_and_costs_nothing_more():
    e, clients = engine(), Clients()
    for payload in ("a", "poison", "b"):
        e.submit(job(payload), 0)
    [first], _ = e.step(0)
    assert len(first.batch.items) == 3        # the poison shared a batch with the innocent
    assert not e.lost(0, MS).explained          # first death: the cause is unknown yet
    e.device_up(0)
    alone = []
    while True:
        dispatches, answers = e.step(2 * MS)
        clients.take(answers)
        if not dispatches:
            break
        for d in dispatches:
            assert len(d.batch.items) == 1
            if d.batch.items[0].payload == "poison":
                loss = e.lost(d.device, 3 * MS)
                assert loss.explained       # died again, alone: proven
                clients.take(loss.answers)
                e.device_up(d.device)
            else:
                clients.take(e.completed(d.device, d.batch.id, ok_outcome(d.batch), 3 * MS))
            alone.append(d.batch.items[0].payload)
    assert clients.codes() == {"a": OK, "b": OK, "poison": P.MODEL_ERROR}
    # The same input again is answered at once, without reaching a device.
    again = e.submit(job("poison#2"), 4 * MS)
    assert again is not None and again.code == P.MODEL_ERROR and "quarantined" in again.message
    assert e.snapshot(4 * MS)["quarantined"] == 1


def test_a_malformed_worker_answer_fails_its_batch_and_nothing_else():
    e, clients = engine(), Clients()
    for i in range(6):
        e.submit(job(i), 0)
    dispatches, _ = e.step(0)
    bad, good = dispatches
    clients.take(e.completed(bad.device, bad.batch.id, Outcome(MS, problem="3 outputs for a batch of 4"), MS))
    clients.take(e.completed(good.device, good.batch.id, ok_outcome(good.batch), MS))
    codes = clients.codes()
    assert sorted(codes.values()) == sorted([OK] * 2 + [P.MODEL_ERROR] * 4)
    assert all(codes[item.payload] == P.MODEL_ERROR for item in bad.batch.items)


def test_per_item_errors_answer_only_their_request():
    e, clients = engine(), Clients()
    for i in range(3):
        e.submit(job(i), 0)
    [d], _ = e.step(0)
    outcome = Outcome(MS, ["x", None, "z"], errors={1: "text input only"}, rejected={1})
    clients.take(e.completed(d.device, d.batch.id, outcome, MS))
    assert clients.codes() == {0: OK, 1: P.BAD_REQUEST, 2: OK}


def test_a_drain_that_times_out_answers_the_rest_shutting_down_and_a_late_result_answers_nobody():
    e, clients = engine(), Clients()
    for i in range(10):
        e.submit(job(i), 0)
    dispatches, _ = e.step(0)
    e.drain()
    assert e.busy()
    clients.take(e.stop(5 * MS))            # the drain's time is up (or a second SIGTERM came)
    assert clients.codes() == {i: P.SHUTTING_DOWN for i in range(10)} and not e.busy()
    for d in dispatches:                     # the workers answer after all: nobody hears twice
        assert e.completed(d.device, d.batch.id, ok_outcome(d.batch), 6 * MS) == []
    assert e.submit(job("late"), 7 * MS).code == P.SHUTTING_DOWN
    assert e.lost(0, 8 * MS).answers == []


def test_with_every_device_given_up_requests_are_answered_unavailable():
    e, clients = engine(devices=2), Clients()
    for i in range(3):
        e.submit(job(i), 0)
    dispatches, _ = e.step(0)
    for d in dispatches:
        clients.take(e.lost(d.device, MS).answers)
    assert e.device_gone(0, MS) == []         # one device left: the requests wait for it
    clients.take(e.device_gone(1, MS))
    assert set(clients.codes().values()) == {P.UNAVAILABLE} and len(clients.answers) == 3
    assert e.submit(job("new"), 2 * MS).code == P.UNAVAILABLE
    e.device_up(1)                             # a device that comes back serves again
    assert e.submit(job("newer"), 3 * MS) is None


def test_the_cache_keeps_tenants_apart_and_a_hit_is_no_completion():
    cache = ResultCache(10)
    e, clients = engine(cache=cache), Clients()
    e.submit(job("t1-first", tenant="t1", cache_key=("m", "t1", "hello")), 0)
    run_all(e, clients, 0)
    hit = e.submit(job("t1-again", tenant="t1", cache_key=("m", "t1", "hello")), MS)
    assert hit is not None and hit.code == OK and hit.output == "out:t1-first" and hit.timing.device == "cache"
    assert e.submit(job("t2", tenant="t2", cache_key=("m", "t2", "hello")), MS) is None   # not t1's answer
    stats = e.snapshot(MS)["channels"]["c"]
    assert stats["cache_hits"] == 1 and stats["completed"] == 1


def test_an_isolated_channel_is_never_served_from_or_stored_in_the_cache():
    cache = ResultCache(10)
    e, clients = engine(cache=cache, isolated=True), Clients()
    e.submit(job(1, tenant="t", cache_key=("m", "t", "x")), 0)
    run_all(e, clients, 0)
    assert len(cache) == 0
    assert e.submit(job(2, tenant="t", cache_key=("m", "t", "x")), MS) is None


def test_expired_requests_are_answered_once_and_their_latency_recorded():
    e, clients = engine(deadline_ms=10_000), Clients()
    e.devices[0].usable = False             # no device: the request can only wait, then expire
    e.submit(Job("m", "c", 1, 5, "short", None), 0)
    clients.take(e.step(10 * MS)[1])
    assert clients.codes() == {"short": P.DEADLINE_EXCEEDED}
    c = e.channels["c"].stats
    assert c.expired == 1 and c.latency.lifetime.total == 1


def test_the_engine_and_the_scheduler_import_no_io():
    """The core must stay sans-I/O: no sockets, event loops, threads or clocks."""
    banned = {"zmq", "asyncio", "threading", "time", "socket", "selectors"}
    files = [*sorted((REPO / "dynbatchd/engine").glob("*.py")), *sorted((REPO / "dynbatchd/scheduler").glob("*.py"))]
    for path in files:
        tree = ast.parse(path.read_text())
        names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
        names |= {node.module.split(".")[0] for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module}
        assert not names & banned, f"{path.name} imports {sorted(names & banned)}"


@pytest.mark.parametrize("feeders", [1, 3])
@pytest.mark.parametrize("seed", range(5))
def test_exactly_once_under_random_deaths_stops_and_results(seed, feeders):
    """Random results, deaths of one feeder (worker process) at a time, and a stop: every
    accepted request is answered once. A dead feeder comes back a few steps later, so a device
    also spends time with some, or none, of its feeders up."""
    import random

    rng = random.Random(seed)
    e, clients = engine(devices=2, inflight=2, feeders=feeders, max_batch=3, queue_limit=50), Clients()
    down: list[tuple[int, int, int]] = []   # (step it comes back, device, feeder)
    accepted, now, held = set(), 0, []
    for step in range(400):
        now += rng.randint(0, 2) * MS
        if rng.random() < 0.6:
            payload = f"r{step}"
            refusal = e.submit(job(payload), now)
            if refusal is None:
                accepted.add(payload)
            else:
                clients.take([refusal])
        dispatches, answers = e.step(now)
        clients.take(answers)
        held.extend(dispatches)
        if held and rng.random() < 0.5:
            d = held.pop(rng.randrange(len(held)))
            clients.take(e.completed(d.device, d.batch.id, ok_outcome(d.batch), now))
        if rng.random() < 0.03:
            device, feeder = rng.randrange(2), rng.randrange(feeders)
            clients.take(e.lost(device, now, feeder).answers)
            held = [d for d in held if (d.device, d.feeder) != (device, feeder)]
            down.append((step + rng.randint(0, 10), device, feeder))
        for back in [b for b in down if b[0] <= step]:
            down.remove(back)
            e.device_up(back[1], back[2])
    clients.take(e.stop(now))
    assert accepted <= set(clients.answers)


def test_the_scheduler_package_reads_no_files():
    """The memory planner reads model files; the scheduler must not (it lives in dynbatchd.memory)."""
    for path in sorted((REPO / "dynbatchd/scheduler").glob("*.py")):
        text = path.read_text()
        assert "open(" not in text and "read_text(" not in text and "pathlib" not in text, path.name


def test_a_queued_batch_is_timed_from_when_the_batch_ahead_ended_not_from_when_it_was_sent():
    """The device table once timed a queued batch from its send: after the batch ahead ended,
    the device looked free too early and every next batch was cut ~one batch early."""
    e, clients = engine(inflight=2, max_batch=2), Clients()
    channel = e.channels["c"]
    for _ in range(4):
        channel.cost.observe(2, 2, 10 * MS)        # a learned cost: 10 ms a batch of two
    for i in range(4):
        e.submit(job(i), 0)
    [first] = e.step(0)[0]
    [second] = e.step(9 * MS)[0]               # queued 1 ms before the first should end
    assert e._views()[0].free_at_ns == 20 * MS
    clients.take(e.completed(0, first.batch.id, ok_outcome(first.batch, 10 * MS), 15 * MS))   # ends late
    assert e._views()[0].free_at_ns == 25 * MS  # the queued one started at 15 ms
    assert e.overdue(30 * MS, 16 * MS) == []                   # hung counts from its start...
    assert e.overdue(30 * MS, 14 * MS) == [(0, 0, 14 * MS)]       # ...and with the limit that passed


def test_a_cancelled_request_leaves_the_queue_answered_once_and_a_running_one_runs_on():
    e, clients = engine(max_batch=1, inflight=1), Clients()
    jobs = [job(i) for i in range(3)]
    for j in jobs:
        e.submit(j, 0)
    [running], _ = e.step(0)                        # job 0 runs; 1 and 2 wait
    answer = e.cancel(jobs[2], MS)
    assert answer.code == P.CANCELLED and answer.payload == 2
    clients.take([answer])
    assert e.cancel(jobs[2], MS) is None            # a second cancel answers nothing more
    assert e.cancel(jobs[0], MS) is None            # running: answered when its batch ends
    run_all_after = e.completed(0, running.batch.id, ok_outcome(running.batch), 2 * MS)
    clients.take(run_all_after)
    run_all(e, clients, 3 * MS)
    assert clients.codes() == {0: OK, 1: OK, 2: P.CANCELLED}
    assert e.snapshot(3 * MS)["channels"]["c"]["cancelled"] == 1


def test_answered_requests_leave_no_reference_cycles_for_the_collector():
    """The daemon collects the young generation rarely (dynbatchd.collector): that is only
    safe while a request's objects are freed by reference counting once it is answered."""
    import gc
    e, clients = engine(max_batch=8, cache=ResultCache(100)), Clients()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for i in range(40):
            e.submit(Job("m", "c", 1, 10_000, i, None, f"text {i % 5}"), i)
        e.cancel(Job("m", "c", 1, 10_000, "never queued"), 40)
        cancelled = job("cancelled")
        e.submit(cancelled, 41)
        clients.take([e.cancel(cancelled, 42)])
        run_all(e, clients, 50)
        gc.collect()
        cyclic = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert len(clients.answers) == 41
    assert cyclic == []


def test_the_serving_daemon_freezes_start_up_objects_and_collects_the_young_less_often():
    """dynbatchd.collector, in a fresh interpreter so this process keeps its own settings."""
    import subprocess
    import sys
    code = ("import gc; from dynbatchd import collector; collector.settle_for_serving(); "
            "print(gc.get_threshold()[0], gc.get_freeze_count() > 1000)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    from dynbatchd.collector import YOUNG_LIMIT
    assert out == [str(YOUNG_LIMIT), "True"]


# -- faults the daemon learns of (issue 23) ------------------------------------------------------
def test_a_batch_that_cannot_be_encoded_fails_only_its_bad_input_and_frees_its_slot():
    """A lone surrogate (valid JSON through the HTTP door, not UTF-8) once made encode_batch raise
    out of the daemon's timer: nobody in the batch was answered and the slot stayed held."""
    from dynbatchd.daemon_batches import Pending, encode_batch, fingerprint, unencodable

    e = Engine(build_channels({"c": ChannelSettings(max_batch=4, window_ms=0, deadline_ms=10_000)}), ["d0"],
               inflight=1, fingerprint=fingerprint)
    e.device_up(0)
    e.quarantine[b"something"] = None      # so that submit fingerprints every input, the bad one too
    clients = Clients()
    texts = ["a", "bad \ud800", "b"]
    for i, text in enumerate(texts):
        assert e.submit(Job("m", "c", 1, 10_000, Pending(None, P.Request(i, "m", text=text))), 0) is None
    [dispatch], _ = e.step(0)
    assert len(dispatch.batch.items) == 3
    with pytest.raises(UnicodeEncodeError):
        encode_batch(dispatch.batch)
    bad = unencodable(dispatch.batch)
    assert list(bad) == [1] and "UnicodeEncodeError" in bad[1] and "\ud800" not in bad[1]
    [answer] = e.unsendable(0, dispatch.batch.id, bad, MS)
    assert answer.payload.request.id == 1 and answer.code == P.BAD_REQUEST and "cannot be encoded" in answer.message
    assert not e.devices[0].held                         # the slot is free at once...
    [rerun], _ = e.step(MS)                              # ...and the batch-mates run without it
    assert [item.payload.request.text for item in rerun.batch.items] == ["a", "b"]
    encode_batch(rerun.batch)
    clients.take([answer, *e.completed(0, rerun.batch.id, ok_outcome(rerun.batch), 2 * MS)])
    assert sorted((p.request.id, code) for p, code in clients.codes().items()) == [(0, OK), (1, P.BAD_REQUEST),
                                                                                 (2, OK)]


def test_a_batch_that_fails_to_encode_with_no_input_to_blame_is_answered_model_error():
    e, clients = engine(inflight=1), Clients()
    for i in range(3):
        e.submit(job(i), 0)
    [dispatch], _ = e.step(0)
    clients.take(e.unsendable(0, dispatch.batch.id, {}, MS))
    assert clients.codes() == {0: P.MODEL_ERROR, 1: P.MODEL_ERROR, 2: P.MODEL_ERROR}
    assert not e.devices[0].held and not e.busy()
    assert e.unsendable(0, dispatch.batch.id, {}, MS) == []   # answered once


def learned(e: Engine, compute_ns: int = MS) -> None:
    """The channel's cost model has timed a few batches (so a suspect's limit can be derived)."""
    for size in (1, 2, 3):
        e.channels["c"].cost.observe(size, size, compute_ns)


def test_a_request_that_hangs_alone_is_quarantined_at_the_first_kill():
    """It used to run once more, alone, and hang a second full period before it was answered."""
    e, clients = engine(), Clients()
    e.submit(job("hang"), 0)
    [dispatch], _ = e.step(0)
    timeout = 5_000 * MS
    assert e.overdue(timeout, timeout) == []
    assert e.overdue(timeout + 1, timeout) == [(0, 0, timeout)]
    loss = e.lost(0, timeout + 2)
    assert loss.explained
    clients.take(loss.answers)
    assert clients.answers["hang"][0] == P.MODEL_ERROR
    assert e.submit(job("hang#again"), timeout + 3).code == P.MODEL_ERROR   # quarantined
    e.device_up(0)
    assert e.step(timeout + 4) == ([], [])


def test_a_hung_batch_finds_its_hanging_input_in_a_fraction_of_a_second_period():
    """The requests of a hung batch rerun alone; each may take SUSPECT_FACTOR times its estimate
    (at least SUSPECT_FLOOR_NS), so the one that hangs again is killed long before a second
    full period, and the others are answered."""
    from dynbatchd.engine import SUSPECT_FLOOR_NS

    e, clients = engine(), Clients()
    learned(e)
    for payload in ("a", "hang", "b"):
        e.submit(job(payload), 0)
    [dispatch], _ = e.step(0)
    timeout = 5_000 * MS
    assert e.overdue(timeout + 1, timeout) == [(0, 0, timeout)]
    loss = e.lost(0, timeout + 2)
    assert loss.answers == [] and not loss.explained   # which one hung is not known yet
    e.device_up(0)
    now = timeout + 3
    while True:
        dispatches, answers = e.step(now)
        clients.take(answers)
        if not dispatches:
            break
        [d] = dispatches
        assert len(d.batch.items) == 1
        if d.batch.items[0].payload != "hang":
            clients.take(e.completed(0, d.batch.id, ok_outcome(d.batch), now + MS))
            now += 2 * MS
            continue
        assert e.overdue(now + SUSPECT_FLOOR_NS, timeout) == []
        assert e.overdue(now + SUSPECT_FLOOR_NS + 1, timeout) == [(0, 0, SUSPECT_FLOOR_NS)]
        loss = e.lost(0, now + SUSPECT_FLOOR_NS + 2)
        assert loss.explained
        clients.take(loss.answers)
        e.device_up(0)
        now += SUSPECT_FLOOR_NS + 3
    assert clients.codes() == {"a": OK, "b": OK, "hang": P.MODEL_ERROR}
    assert len(e.quarantine) == 1


def test_a_suspect_gets_the_full_timeout_until_its_channel_has_learned_a_cost():
    """A slow model's first batch must not be judged by an unlearned estimate of zero."""
    e = engine()
    for payload in ("a", "b"):
        e.submit(job(payload), 0)
    e.step(0)
    e.lost(0, MS)                          # a crash: both rerun alone
    e.device_up(0)
    [d], _ = e.step(2 * MS)
    assert len(d.batch.items) == 1
    timeout = 5_000 * MS
    assert e.overdue(2 * MS + 2 * 10**9, timeout) == []
    assert e.overdue(2 * MS + timeout + 1, timeout) == [(0, 0, timeout)]


def test_a_feeder_that_reports_a_cpu_stage_gets_its_next_batch_that_much_before_the_device_frees():
    # Batches of 4 take 20 ms on the device; the pipelined feeder spends 8 ms preparing each one first.
    e, clients = engine(inflight=2, max_batch=4), Clients()
    for i in range(8):
        assert e.submit(job(f"warm{i}"), 0) is None
    first, second = e.step(0)[0]
    clients.take(e.completed(0, first.batch.id, Outcome(20 * MS, ["x"] * 4, prepare_ns=8 * MS), 20 * MS))
    clients.take(e.completed(0, second.batch.id, Outcome(20 * MS, ["x"] * 4, prepare_ns=8 * MS), 40 * MS))
    assert e.snapshot(40 * MS)["devices"][0]["cpu_stage_ms"] == 8.0
    for i in range(8):
        assert e.submit(job(f"r{i}"), 40 * MS) is None
    (running,), _ = e.step(40 * MS)                   # the device is idle: one batch goes at once
    assert e.step(51 * MS)[0] == []                   # running until ~60 ms: not yet 8 ms before its end
    (queued,), _ = e.step(52 * MS)                    # 8 ms before: the next one goes, to be tokenised meanwhile
    assert queued.batch.id != running.batch.id


def test_a_pipelined_feeder_that_dies_makes_suspects_of_the_batch_it_was_preparing_too():
    # A feeder that reports a CPU stage tokenises its next batch while one runs: an input that kills
    # it there must be retried alone like the running ones, or it never gets proven poison.
    e, clients = engine(inflight=2, max_batch=2), Clients()
    for i in range(4):
        assert e.submit(job(f"w{i}"), 0) is None
    for d in e.step(0)[0]:
        clients.take(e.completed(0, d.batch.id, Outcome(10 * MS, ["x"] * 2, prepare_ns=5 * MS), 10 * MS))
    for i in range(6):
        assert e.submit(job(f"r{i}"), 20 * MS) is None
    running, = e.step(20 * MS)[0]
    preparing, = e.step(25 * MS)[0]                     # its CPU stage (5 ms) before the running one ends
    loss = e.lost(0, 26 * MS)
    assert not loss.explained and not loss.answers
    assert [item.retries for item in running.batch.items + preparing.batch.items] == [1, 1, 1, 1]
    assert e.scheduler.depth() == 6                    # both batches back in the queue, each request to run alone


def queued_slot_opens_at(pass_ms: float) -> tuple[int, int]:
    """(ms when the slot behind a running batch opens, the lead), where each scheduling pass
    takes `pass_ms` by the daemon's clock: batches of four take 20 ms (learned), one starts at
    100 ms and four more requests wait behind it."""
    ticks = iter(range(0, 10**12, int(pass_ms * MS)))
    e = Engine(build_channels({"c": ChannelSettings(max_batch=4, window_ms=0, deadline_ms=10_000)}), ["d0"],
               pass_clock=lambda: next(ticks))
    e.device_up(0, 0)
    for k in range(12):
        for i in range(4):
            e.submit(job(f"{k}-{i}"), 0)
        [d], _ = e.step(0)
        e.completed(d.device, d.batch.id, ok_outcome(d.batch, 20 * MS), 0)
    for i in range(4):
        e.submit(job(f"a{i}"), 100 * MS)
    [running], _ = e.step(100 * MS)
    for i in range(4):
        e.submit(job(f"b{i}"), 101 * MS)
    assert e.step(101 * MS) == ([], [])   # (the device frees at 120 ms: not yet)
    return round(e.next_wakeup() / MS), e.lead_ns // MS


def test_the_slot_behind_a_running_batch_opens_as_early_as_the_daemons_passes_take():
    # Passes of 0.5 ms: the configured lead (1 ms) hides them, the slot opens at 119 ms. Passes of
    # 5 ms: it opens at 115, so the batch is cut by the time the device frees, not 4 ms after.
    assert queued_slot_opens_at(0.5) == (119, 1)
    assert queued_slot_opens_at(5.0) == (115, 5)
    e = engine()   # without the daemon's clock (the simulator's passes take no time): as configured
    e.submit(job(0), 0)
    e.step(0)
    assert e.lead_ns == MS and e.snapshot(0)["scheduling"]["passes"] == 0


def test_what_the_devices_hold_is_worked_out_once_per_clock_reading_until_a_batch_ends():
    """Past the peak every request's wait is predicted, and with it the device time the devices
    still hold. The daemon's drain of requests shares one clock reading: that figure is worked out
    once for all of them, and anew as soon as a batch is placed, ends or is lost."""
    e = engine(inflight=1, max_batch=2)
    for _ in range(30):   # batches of 2 take 10 ms: settled, so the channel predicts waits
        e.channels["c"].cost.observe(2, 2, 10 * MS)
    clients = Clients()
    for n in range(2):
        assert e.submit(job(f"r{n}"), 0) is None
    (running,), _ = e.step(0)   # the device holds one batch of 2, due to end at 10 ms
    estimates = []
    plain = e._estimate
    e._estimate = lambda batch, device=None: estimates.append(batch.id) or plain(batch, device)
    for n in range(2, 6):   # a backlog of a batch or more: each of these has its wait predicted
        assert e.submit(job(f"r{n}"), 1 * MS) is None
    assert e._inflight_ns(1 * MS) == pytest.approx(9 * MS, abs=10)
    assert estimates == [running.batch.id]   # once, for the four requests read at 1 ms
    clients.take(e.completed(running.device, running.batch.id, ok_outcome(running.batch), 1 * MS))
    assert e._inflight_ns(1 * MS) == 0        # the same reading, but the batch has ended
    assert e._inflight_ns(2 * MS) == 0
    run_all(e, clients, 2 * MS)
    assert set(clients.codes().values()) == {OK} and len(clients.answers) == 6
