"""The daemon's side of generative requests (dynbatchd.generating) against a stand-in daemon, pool
and socket: no processes. Which worker takes a job, chunk frames and their numbering, the one
final reply, cancel, a lost worker and a stop."""

from __future__ import annotations

import types

import msgspec

from dynbatchd import protocol as P
from dynbatchd.daemon_batches import Pending
from dynbatchd.engine import OK, Job
from dynbatchd.generating import Generations


class Generative:
    decode_step = None


class FakeDaemon:
    def __init__(self):
        self.config = types.SimpleNamespace(
            models={"llm": types.SimpleNamespace(runner="causal-lm"), "emb": types.SimpleNamespace(runner="noop")},
            channels={"chat": types.SimpleNamespace(priority=2, ttft_ms=500.0, tpot_ms=None)})
        self.plugins = types.SimpleNamespace(runners=lambda: {"causal-lm": Generative, "noop": object})
        self.sent: list[tuple[int, object]] = []
        self.pool = types.SimpleNamespace(
            workers=[types.SimpleNamespace(index=i, state="ready", models=("llm",)) for i in range(2)],
            send=lambda worker, frames: self.sent.append((worker, P.daemon_decoder.decode(frames[0]))) or True)
        self.frames: list[list[bytes]] = []
        self.front = types.SimpleNamespace(io=types.SimpleNamespace(send=self.frames.append))
        self.answers = []
        self.state = "serving"
        self.membership = types.SimpleNamespace(unloading_models=set())   # no reload removing a model
        self.now = 1_000_000

    def clock(self):
        return self.now

    def _send(self, answers, channel=None):
        self.answers.extend(answers)

    def _schedule_pump(self):
        pass


def start(gens, daemon, rid, stream=True, **generate):
    request = P.Request(rid, "llm", text="w1 w2", stream=stream, generate=generate or None)
    pending = Pending([b"client"], request, [])
    gens.start(Job("llm", "chat", 2, 1000.0, pending), pending, daemon.clock())
    return daemon.sent[-1]


def test_only_causal_lm_models_are_generative():
    gens = Generations(FakeDaemon())
    assert gens.generative("llm") and not gens.generative("emb") and not gens.generative("nope")


def test_jobs_go_to_the_least_busy_worker_with_the_channels_targets():
    daemon = FakeDaemon()
    gens = Generations(daemon)
    (w1, first), (w2, second) = start(gens, daemon, 1, max_new_tokens=5), start(gens, daemon, 2)
    assert {w1, w2} == {0, 1}
    assert isinstance(first, P.GenerateJob) and first.options == {"max_new_tokens": 5}
    assert (first.channel, first.priority, first.ttft_ms, first.tpot_ms, first.deadline_ms) == ("chat", 2, 500.0, None,
                                                                                                1000.0)


def test_a_stream_gets_numbered_chunks_then_one_final_reply_without_text():
    daemon = FakeDaemon()
    gens = Generations(daemon)
    worker, job = start(gens, daemon, "s")
    gens.on_message(worker, P.GenTokens([(job.job, "w3", 1)]))
    gens.on_message(worker, P.GenTokens([(job.job, " w4", 2)]))
    daemon.now += 5_000_000
    gens.on_message(worker, P.GenEnd(job.job, "length", 3, 2, "w3 w4", ttft_us=100, tpot_us=50, total_us=4000))
    chunks = [msgspec.msgpack.decode(f[1]) for f in daemon.frames]
    assert chunks == [{"id": "s", "chunk": 0, "text": "w3", "tokens": 1},
                      {"id": "s", "chunk": 1, "text": " w4", "tokens": 2}]
    (answer,) = daemon.answers
    assert answer.code == OK and answer.output[0] == {"finish_reason": "length", "output_tokens": 3, "prompt_tokens": 2}
    assert answer.timing.total_us == 5000 and answer.timing.ttft_us == 1100 and answer.timing.queue_us == 1000
    gens.on_message(worker, P.GenEnd(job.job, "length"))   # a late duplicate answers nobody
    assert len(daemon.answers) == 1 and gens.snapshot()["generated_tokens"] == {"chat": 3}


def test_a_request_not_streamed_gets_no_chunks_and_its_text_at_the_end():
    daemon = FakeDaemon()
    gens = Generations(daemon)
    worker, job = start(gens, daemon, 1, stream=False)
    gens.on_message(worker, P.GenTokens([(job.job, "w3", 1)]))
    gens.on_message(worker, P.GenEnd(job.job, "stop", 1, 2, "w3"))
    assert daemon.frames == [] and daemon.answers[0].output[0]["text"] == "w3"


def test_cancel_goes_to_the_jobs_worker_and_errors_keep_their_codes():
    daemon = FakeDaemon()
    gens = Generations(daemon)
    worker, job = start(gens, daemon, 9)
    assert not gens.cancel(b"other", 9) and gens.cancel(b"client", 9)
    assert daemon.sent[-1] == (worker, P.GenerateCancel(job.job))
    gens.on_message(worker, P.GenEnd(job.job, "cancelled", 4))
    worker, job = start(gens, daemon, 10)
    gens.on_message(worker, P.GenEnd(job.job, "bad_request", message="can never fit the KV budget of 400 tokens"))
    assert [(a.code, a.message) for a in daemon.answers] == [
        (P.CANCELLED, "cancelled after 4 tokens"), (P.BAD_REQUEST, "can never fit the KV budget of 400 tokens")]
    assert gens.snapshot()["running"] == 0


def test_a_lost_worker_and_a_stop_answer_every_job_once():
    daemon = FakeDaemon()
    gens = Generations(daemon)
    (w1, _), (w2, _) = start(gens, daemon, 1), start(gens, daemon, 2)
    gens.lost(w1)
    assert [a.code for a in daemon.answers] == [P.MODEL_ERROR]
    gens.stop()
    assert [a.code for a in daemon.answers] == [P.MODEL_ERROR, P.SHUTTING_DOWN] and not gens.jobs


def test_no_worker_holding_the_model_is_unavailable():
    daemon = FakeDaemon()
    for worker in daemon.pool.workers:
        worker.state = "starting"
    gens = Generations(daemon)
    request = P.Request(1, "llm", text="w1")
    pending = Pending([b"client"], request, [])
    gens.start(Job("llm", "chat", 2, 1000.0, pending), pending, daemon.clock())
    assert [a.code for a in daemon.answers] == [P.UNAVAILABLE] and daemon.sent == []


def test_a_job_its_worker_never_ends_is_answered_past_its_deadline():
    daemon = FakeDaemon()
    timers = []

    class Timer:
        def __init__(self, delay, fn, *args):
            self.delay, self.call, self.cancelled = delay, lambda: fn(*args), False
            timers.append(self)

        def cancel(self):
            self.cancelled = True

    daemon.loop = types.SimpleNamespace(call_later=Timer)
    gens = Generations(daemon)
    worker, job = start(gens, daemon, 1)
    worker2, job2 = start(gens, daemon, 2)
    gens.on_message(worker2, P.GenEnd(job2.job, "length", 1))
    assert timers[0].delay == 1.0 + 2.0 and timers[1].cancelled
    timers[0].call()   # the event loop's timer fires: the worker never answered job 1
    assert daemon.sent[-1] == (worker, P.GenerateCancel(job.job, P.DEADLINE_EXCEEDED))
    assert [a.code for a in daemon.answers] == [OK, P.DEADLINE_EXCEEDED]
    gens.on_message(worker, P.GenEnd(job.job, "deadline_exceeded"))   # its late end: nobody answered twice
    assert len(daemon.answers) == 2


def test_a_prompt_that_is_not_text_is_a_bad_request():
    daemon = FakeDaemon()
    gens = Generations(daemon)
    pending = Pending([b"client"], P.Request(1, "llm", value=[1, 2]), [])
    gens.start(Job("llm", "chat", 2, 1000.0, pending), pending, daemon.clock())
    assert [a.code for a in daemon.answers] == [P.BAD_REQUEST] and daemon.sent == []


def test_the_channels_counters_count_generate_requests():
    from dynbatchd.config import ChannelSettings
    from dynbatchd.engine import Engine
    from dynbatchd.scheduler import build_channels

    daemon = FakeDaemon()
    settings = ChannelSettings(max_batch=1, window_ms=0, deadline_ms=1000)
    daemon.engine = Engine(build_channels({"chat": settings}), ["cpu"])   # counted through count_generated
    stats = daemon.engine.channels["chat"].stats
    gens = Generations(daemon)
    for rid, reason in ((1, "length"), (2, "cancelled"), (3, "deadline_exceeded"), (4, "error")):
        worker, job = start(gens, daemon, rid)
        gens.on_message(worker, P.GenEnd(job.job, reason))
    assert (stats.accepted, stats.completed, stats.cancelled, stats.expired, stats.failed) == (4, 1, 1, 1, 1)
    worker, job = start(gens, daemon, 5)
    daemon.now += 2_000_000_000   # 2 s later, past its 1 s deadline
    gens.on_message(worker, P.GenEnd(job.job, "stop", 3))
    assert (stats.completed, stats.late) == (2, 1)
