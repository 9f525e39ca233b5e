"""The hostile pass's faults in the worker's loop and the daemon's side of generation, with fakes
(no torch, no processes), each failing before its fix: a model raising in a step ended every job
of the model and lost the ends already made in that step (a bad_request's reply waited for its
deadline); a SystemExit from a model's step ended the worker; a second cancel under a reused id
reached nothing; a door's lone surrogate in a stop string kept a job nobody would answer; a
refused chunk went on being generated for; generate jobs ignored their channel's queue_limit."""

from __future__ import annotations

import types

import pytest
from test_generating import FakeDaemon, start
from test_serving_loop import FakeRunner, FakeSocket, make, run_all

from dynbatchd import protocol as P
from dynbatchd.daemon_batches import Pending
from dynbatchd.devices.execution import WorkerStopping
from dynbatchd.engine import OK, Job
from dynbatchd.generating import Generations
from dynbatchd.generation.serving import StepCost


def fails_for(runner, marked, exc=RuntimeError("index out of range in self")):
    """Make the runner's forward raise whenever a sequence with a prompt of `marked` words is in it."""
    def wrap(call):
        def step(ids):
            if any(len(runner.sequences[i].prompt_ids) == marked for i in ids):
                raise exc
            return call(ids)
        return step
    runner.prefill, runner.decode_step = wrap(runner.prefill), wrap(runner.decode_step)


def ends(messages):
    return {m.job: m for m in messages if isinstance(m, P.GenEnd)}


def test_a_sequence_the_model_cannot_run_ends_alone_and_the_others_keep_their_text():
    alone_runner, alone = make()
    for n in range(3):
        alone.take(P.GenerateJob(n, "m", "a b c", {"max_new_tokens": 6}))
    expected = {n: end.text for n, end in ends(run_all(alone)).items()}
    runner, loop = make()
    fails_for(runner, 5)
    for n in range(3):
        loop.take(P.GenerateJob(n, "m", "a b c", {"max_new_tokens": 6}))
    loop.step()                                      # all three prefilled, then the marked one joins
    loop.take(P.GenerateJob(9, "m", "p o i s n", {"max_new_tokens": 6}))
    got = ends(run_all(loop))
    assert got[9].reason == "error" and got[9].message == "generation failed: the model failed its step (RuntimeError)"
    assert {n: got[n].text for n in expected} == expected and all(got[n].reason == "length" for n in expected)
    assert runner.sequences == {} and loop.scheduler.ledger.in_use_bytes == 0


def test_a_failing_step_keeps_the_ends_already_made_in_it():
    """A prompt refused at take (bad_request) and a failing forward in the same step: the worker
    used to end the model's jobs and drop the refusal, which then waited for its deadline."""
    sock = FakeSocket()
    from dynbatchd.devices.worker import Generating

    generating = Generating(sock)
    runner = FakeRunner()
    runner.options = {"kv_budget_tokens": 100}
    runners = {"m": runner}
    generating.handle(P.GenerateJob(1, "m", "a b", options={"max_new_tokens": 9}), runners)
    generating.step()
    runner.decode_step = lambda ids: 1 / 0                           # the model fails mid-generation
    generating.handle(P.GenerateJob(2, "m", "   ", options={"max_new_tokens": 9}), runners)   # empty: refused
    while generating.busy:
        generating.step()
    got = ends(sock.sent)
    assert {job: end.reason for job, end in got.items()} == {1: "error", 2: "bad_request"}
    assert "ZeroDivisionError" in got[1].message


def test_a_system_exit_from_the_models_step_ends_its_sequence_not_the_worker():
    """(The worker's catch was Exception: a model's SystemExit ended the worker and all its work.)"""
    exc = SystemExit(3)
    runner, loop = make()
    loop.take(P.GenerateJob(1, "m", "a b c", {"max_new_tokens": 4}))
    loop.take(P.GenerateJob(2, "m", "x y", {"max_new_tokens": 4}))
    fails_for(runner, 2, exc)
    got = ends(run_all(loop))
    assert (got[1].reason, got[2].reason) == ("length", "error") and type(exc).__name__ in got[2].message


def test_the_workers_own_stop_still_gets_through_a_step():
    runner, loop = make()
    loop.take(P.GenerateJob(1, "m", "a b", {"max_new_tokens": 4}))
    fails_for(runner, 2, WorkerStopping(0))
    with pytest.raises(WorkerStopping):
        loop.step()


def test_ends_made_before_a_step_raised_are_sent_with_the_next_one():
    """Hardening: a step that raises after its ends were made (here the loop's own step-cost
    bookkeeping) no longer loses them; the worker's catch ends the rest."""
    class Broken(StepCost):
        def observe(self, *args):
            if not getattr(self, "raised", False):
                self.raised = True
                raise ValueError("bookkeeping")

    runner, loop = make()
    loop.cost = Broken()
    loop.take(P.GenerateJob(1, "m", "a b", {"max_new_tokens": 4}))
    loop.take(P.GenerateJob(2, "m", "", {"max_new_tokens": 4}))      # refused at take: ends at the next step
    with pytest.raises(ValueError):
        loop.step()
    assert loop.busy and [(m.job, m.reason) for m in loop.step() if isinstance(m, P.GenEnd)][0] == (2, "bad_request")


# -- the daemon's side ------------------------------------------------------------------------

def test_each_cancel_under_a_reused_id_reaches_one_of_its_requests():
    """The protocol serves two requests under one id; once the newer ended, the older's cancel
    went nowhere and it generated on to its end."""
    daemon = FakeDaemon()
    gens = Generations(daemon)
    (w1, older), (w2, newer) = start(gens, daemon, 7), start(gens, daemon, 7)
    assert gens.cancel(b"client", 7) and daemon.sent[-1] == (w2, P.GenerateCancel(newer.job))
    gens.on_message(w2, P.GenEnd(newer.job, "cancelled", 1))
    assert gens.cancel(b"client", 7) and daemon.sent[-1] == (w1, P.GenerateCancel(older.job))
    (w3, third), (w4, fourth) = start(gens, daemon, 8), start(gens, daemon, 8)   # two cancels before any end
    gens.cancel(b"client", 8)
    gens.cancel(b"client", 8)
    assert daemon.sent[-2:] == [(w4, P.GenerateCancel(fourth.job)), (w3, P.GenerateCancel(third.job))]


def test_a_lone_surrogate_in_a_doors_stop_string_is_a_bad_request_and_nothing_is_kept():
    daemon = FakeDaemon()
    gens = Generations(daemon)
    request = P.Request(1, "llm", text="w1 w2", generate={"stop": ["\ud800"]})   # a door's JSON allows it
    pending = Pending([b"local:1"], request, [])
    gens.start(Job("llm", "chat", 2, 1000.0, pending), pending, daemon.clock())
    assert [a.code for a in daemon.answers] == [P.BAD_REQUEST] and "encoded" in daemon.answers[0].message
    assert not gens.jobs and not gens.by_client and daemon.sent == []


def test_a_chunk_zeromq_refuses_withdraws_the_job_once():
    daemon = FakeDaemon()
    refused = []
    daemon.front = types.SimpleNamespace(io=types.SimpleNamespace(send=lambda frames: refused.append(frames) or False))
    gens = Generations(daemon)
    worker, job = start(gens, daemon, "s")
    for n in range(3):
        gens.on_message(worker, P.GenTokens([(job.job, f" w{n}", 1)]))
    assert len(refused) == 1 and daemon.sent[-1] == (worker, P.GenerateCancel(job.job))
    assert sum(isinstance(m, P.GenerateCancel) for _, m in daemon.sent) == 1
    assert not gens.cancel(b"other", "s") and gens.cancel(b"client", "s")   # already withdrawn: nothing more sent
    assert sum(isinstance(m, P.GenerateCancel) for _, m in daemon.sent) == 1
    gens.on_message(worker, P.GenEnd(job.job, "cancelled", 3))
    assert [a.code for a in daemon.answers] == [P.CANCELLED] and gens.snapshot()["generated_tokens"] == {"chat": 3}


def test_generate_jobs_past_the_channels_queue_limit_are_overloaded_and_counted():
    daemon = FakeDaemon()
    daemon.config.channels["chat"].queue_limit = 2
    stats = types.SimpleNamespace(overloaded=0)
    daemon.engine = types.SimpleNamespace(channels={"chat": types.SimpleNamespace(stats=stats)},
                                          count_generated=lambda *a, **k: None)
    gens = Generations(daemon)
    (w1, first), _ = start(gens, daemon, 1), start(gens, daemon, 2)
    start(gens, daemon, 3)
    assert [a.code for a in daemon.answers] == [P.OVERLOADED] and stats.overloaded == 1 and len(gens.jobs) == 2
    gens.on_message(w1, P.GenEnd(first.job, "length", 1))
    start(gens, daemon, 4)
    assert len(gens.jobs) == 2 and [a.code for a in daemon.answers] == [P.OVERLOADED, OK]


def test_the_kv_in_use_is_kept_per_model_of_a_worker():
    """Two causal-lm models on one worker, each its own loop and ledger: the end of one model's job
    (its loop at 0) set the worker's KV in status to 0 while the other's loop held 3,002 tokens."""
    daemon = FakeDaemon()
    daemon.pool.workers = daemon.pool.workers[:1]
    daemon.pool.workers[0].models = ("llm", "llm2")
    timers = []
    daemon.loop = types.SimpleNamespace(call_later=lambda delay, fn, *args: timers.append(lambda: fn(*args))
                                        or types.SimpleNamespace(cancel=lambda: None))
    gens = Generations(daemon)
    (worker, first), (_, second) = start(gens, daemon, 1), start(gens, daemon, 2)
    request = P.Request(3, "llm2", text="w1 w2")
    pending = Pending([b"client"], request, [])
    gens.start(Job("llm2", "chat", 2, 1000.0, pending), pending, daemon.clock())
    other = daemon.sent[-1][1]
    gens.on_message(worker, P.GenEnd(second.job, "length", 1, kv_in_use_bytes=3002))
    gens.on_message(worker, P.GenEnd(other.job, "length", 1, kv_in_use_bytes=0))
    assert gens.snapshot()["kv_in_use_tokens"] == 3002
    timers[0]()                                   # the first job answered overdue; its worker's end comes late
    gens.on_message(worker, P.GenEnd(first.job, "deadline_exceeded", kv_in_use_bytes=0))
    assert gens.snapshot()["kv_in_use_tokens"] == 0 and not gens.answered_early


def test_a_loop_of_a_model_a_reload_removed_goes_once_idle():
    """The worker kept a removed model's loop, and so its runner (the weights), for good."""
    from dynbatchd.devices.worker import Generating

    sock = FakeSocket()
    generating = Generating(sock)
    runner = FakeRunner()
    runner.options = {"kv_budget_tokens": 100}
    generating.handle(P.GenerateJob(1, "m", "a b", options={"max_new_tokens": 4}), {"m": runner})
    generating.step()
    generating.runners = {}   # a reload removed m (the daemon waits for its jobs; the worker finishes them)
    generating.step()
    assert "m" in generating.loops   # still generating
    while generating.busy:
        generating.step()
    assert "m" not in generating.loops and ends(sock.sent)[1].reason == "length"
