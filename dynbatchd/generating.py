"""The daemon's side of generative requests: a causal-lm model's job to its worker, chunks and
the one final reply back.

After the intake (compliance, tenancy, routing, deadline default) a request for a generative
model does not join the engine's batches: it goes at once, as a `GenerateJob` carrying its
channel's targets, to a worker holding the model (the one with the fewest jobs), whose step loop
(`dynbatchd.generation.serving`) batches it continuously with the others. The worker's
`GenTokens` become `Chunk` frames of a streamed request (a ZeroMQ frame to its envelope, or
`LocalEnvelope.push` for an in-process door); its `GenEnd` becomes the one final reply, through
the daemon's `_send` like any answer (quota release, counting, logging). A client cancel becomes
a `GenerateCancel`; the worker frees the KV at the next token boundary and ends the job, as it
does for a stream whose chunk ZeroMQ refuses (its client left). A channel holds at most its
`queue_limit` generate jobs (waiting or generating): each waiting one costs every step its look.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from dynbatchd import protocol as P
from dynbatchd.engine import OK, Answer
from dynbatchd.generation.batching import ENDED_WELL, InFlight
from dynbatchd.telemetry import Histogram

log = logging.getLogger("dynbatchd")

# The channel counter each final code adds to (bad_request: the client's mistake, as at intake).
COUNTERS = {OK: "completed", P.DEADLINE_EXCEEDED: "expired", P.CANCELLED: "cancelled", P.MODEL_ERROR: "failed",
            P.SHUTTING_DOWN: "failed", P.UNAVAILABLE: "failed"}
OVERDUE_GRACE_S = 2.0   # past a job's deadline, how long the daemon waits for its worker's end
# The /metrics histogram's upper edges for TTFT and TPOT: powers of two microseconds, 256 us to 67 s
# (the Histogram's own edges, so each count is exact to its bucket).
BUCKET_EDGES_US = tuple(2 ** k for k in range(8, 27))
CODES = {"cancelled": P.CANCELLED, "deadline_exceeded": P.DEADLINE_EXCEEDED, "bad_request": P.BAD_REQUEST,
         "too_large": P.BAD_REQUEST}


@dataclass(slots=True)
class Running:
    pending: Any        # the daemon's Pending (envelope, request, frames)
    channel: str
    worker: int
    accepted_ns: int
    chunks: int = 0
    tokens: int = 0
    deadline_ms: float | None = None
    overdue: Any = None   # the backstop timer: answered by the daemon if the worker never ends it
    gone: bool = False    # a chunk was refused (the client left): no more chunks sent
    withdrawn: bool = False   # a cancel was sent to its worker (its end follows from there)


class Generations:
    """Generate jobs in flight, by job number; `daemon` is the `dynbatchd.service.Daemon`."""

    def __init__(self, daemon: Any):
        self.daemon = daemon
        self.jobs: dict[int, Running] = {}
        self.by_client: dict[tuple[bytes, Any], list[int]] = {}   # a client's id -> its jobs, oldest first
        self.in_flight = InFlight()                 # channel -> its generate jobs in flight (queue_limit)
        self.next_job = 1
        # (worker, model) -> KV tokens its loop holds (after its last end): one figure per worker
        # once showed 0 while another model's loop there held thousands
        self.kv_in_use: dict[tuple[int, str], int] = {}
        self.answered_early: dict[int, tuple[int, str]] = {}   # overdue job -> (worker, model): its end still comes
        self.generated_tokens: dict[str, int] = {}  # channel -> tokens generated
        self.ended: dict[str, int] = {}             # finish reason -> count
        self.ttft: dict[str, Histogram] = {}        # channel -> time to first token (us), successful ends
        self.tpot: dict[str, Histogram] = {}        # channel -> mean time per output token (us)
        self._config: Any = None
        self._generative: set[str] = set()

    def generative(self, model: str) -> bool:
        """Whether `model`'s runner steps token by token (causal-lm); worked out once per config."""
        config = self.daemon.config
        if self._config is not config:
            runners = self.daemon.plugins.runners()
            self._generative = {name for name, spec in config.models.items()
                                if hasattr(runners.get(spec.runner), "decode_step")}
            self._config = config
        return model in self._generative

    def start(self, job: Any, pending: Any, now_ns: int) -> None:
        """Hand an admitted request to a worker holding its model (or answer it unavailable)."""
        request, pool = pending.request, self.daemon.pool
        if request.text is None:
            self.daemon._send((Answer(pending, P.BAD_REQUEST, f"model {request.model!r} generates from a text prompt"),),
                              job.channel)
            return
        workers = [w for w in getattr(pool, "workers", ()) if w.state == "ready" and request.model in w.models]
        if not workers:
            self.daemon._send((Answer(pending, P.UNAVAILABLE, f"no worker holds model {request.model!r} now"),), job.channel)
            return
        settings = self.daemon.config.channels[job.channel]
        limit = getattr(settings, "queue_limit", None)
        if self.in_flight.full(job.channel, limit):
            self._overloaded(job.channel)
            self.daemon._send((Answer(pending, P.OVERLOADED, f"channel {job.channel!r} queue is full "
                                                             f"({limit} generating or waiting)"),), job.channel)
            return
        number = self.next_job
        message = P.GenerateJob(number, request.model, request.text or "", dict(request.generate or {}), job.channel,
                                settings.priority, getattr(settings, "ttft_ms", None),
                                getattr(settings, "tpot_ms", None), job.deadline_ms)
        try:   # before it is counted or kept: a door's lone surrogate (in a stop string) once stayed until overdue
            frame = P.encoder.encode(message)
        except Exception as exc:
            self.daemon._send((Answer(pending, P.BAD_REQUEST, f"the request cannot be encoded for its worker "
                                                              f"({type(exc).__name__}: not UTF-8 text?)"),), job.channel)
            return
        load = {w.index: 0 for w in workers}
        for run in self.jobs.values():
            if run.worker in load:
                load[run.worker] += 1
        worker = min(load, key=load.get)
        self.next_job += 1
        run = self.jobs[number] = Running(pending, job.channel, worker, now_ns, deadline_ms=job.deadline_ms)
        self.in_flight.add(job.channel)
        self._count(job.channel, "accepted")
        self.by_client.setdefault((pending.envelope[0], request.id), []).append(number)
        if job.deadline_ms and (loop := getattr(self.daemon, "loop", None)) is not None:
            run.overdue = loop.call_later(job.deadline_ms / 1000 + OVERDUE_GRACE_S, self.overdue, number)
        if not pool.send(worker, [frame]):
            self._finish(number, Answer(pending, P.UNAVAILABLE, "the model's worker could not be reached"))

    def cancel(self, identity: bytes, request_id: Any) -> bool:
        """A client's cancel of a generate job (True: it was one; its final reply comes from the worker)."""
        numbers = self.by_client.get((identity, request_id))
        if not numbers:
            return False
        for number in reversed(numbers):   # two in flight under one id: a cancel each, the newest first
            if not (run := self.jobs[number]).withdrawn:
                self._withdraw(number, run)
                break
        return True

    def _withdraw(self, number: int, run: Running) -> None:
        """Tell its worker to end job `number` now (cancelled), once."""
        run.withdrawn = True
        self.daemon.pool.send(run.worker, [P.encoder.encode(P.GenerateCancel(number))])

    def overdue(self, number: int) -> None:
        """A job still unanswered well past its deadline (its worker stuck in one long step, or
        gone unseen): answered deadline_exceeded here, and the worker told to drop it."""
        run = self.jobs.get(number)
        if run is None:
            return
        log.warning("generate job %d not ended by its worker %.1f s past its deadline: answered here", number,
                    OVERDUE_GRACE_S)
        self.daemon.pool.send(run.worker, [P.encoder.encode(P.GenerateCancel(number, P.DEADLINE_EXCEEDED))])
        self.answered_early[number] = (run.worker, run.pending.request.model)
        self._finish(number, Answer(run.pending, P.DEADLINE_EXCEEDED, "deadline passed mid-generation"))

    def on_message(self, worker: int, msg: Any) -> None:
        if isinstance(msg, P.GenTokens):
            for number, text, tokens in msg.items:
                if (run := self.jobs.get(number)) is not None:
                    self._chunk(number, run, text, tokens)
        elif isinstance(msg, P.GenEnd):
            run = self.jobs.get(msg.job)
            model = run.pending.request.model if run is not None else self.answered_early.pop(msg.job, (0, None))[1]
            if model is not None:
                self.kv_in_use[(worker, model)] = msg.kv_in_use_bytes
            if run is not None:
                self._finish(msg.job, self._answer(run, msg))

    def lost(self, worker: int) -> None:
        """Worker `worker` died: its jobs end with model_error (their KV went with it)."""
        self.kv_in_use = {key: n for key, n in self.kv_in_use.items() if key[0] != worker}
        self.answered_early = {job: at for job, at in self.answered_early.items() if at[0] != worker}
        for number, run in list(self.jobs.items()):
            if run.worker == worker:
                self._finish(number, Answer(run.pending, P.MODEL_ERROR, "the model's worker stopped mid-generation"))

    def stop(self) -> None:
        """The daemon stops: every job still generating is answered shutting_down (its worker goes too)."""
        for number, run in list(self.jobs.items()):
            self._finish(number, Answer(run.pending, P.SHUTTING_DOWN, "daemon is shutting down"))

    def snapshot(self) -> dict[str, Any]:
        def summary(hists: dict[str, Histogram]) -> dict[str, dict[str, Any]]:
            return {c: {"p50_ms": h.quantile(0.5) / 1000, "p99_ms": h.quantile(0.99) / 1000, "count": h.total,
                        "sum_ms": h.sum_us / 1000, "buckets": buckets(h)} for c, h in hists.items()}

        return {"running": len(self.jobs), "kv_in_use_tokens": sum(self.kv_in_use.values()),
                "generated_tokens": dict(self.generated_tokens), "ended": dict(self.ended),
                "ttft": summary(self.ttft), "tpot": summary(self.tpot)}

    # -- the replies -----------------------------------------------------------------------------
    def _chunk(self, number: int, run: Running, text: str, tokens: int) -> None:
        run.tokens += tokens
        self.generated_tokens[run.channel] = self.generated_tokens.get(run.channel, 0) + tokens
        request = run.pending.request
        if not request.stream or run.gone:
            return
        chunk = P.Chunk(request.id, run.chunks, text, tokens)
        run.chunks += 1
        envelope = run.pending.envelope
        push = getattr(envelope, "push", None)
        if push is not None:
            push(chunk)
        elif hasattr(envelope, "settle"):
            return   # an in-process door that cannot stream: it gets the final reply only
        elif (front := self.daemon.front) is not None and front.io.send([*envelope, P.encoder.encode(chunk)]) is False:
            # ROUTER_MANDATORY refused it: the client left (or stopped reading): generating on is for nobody
            run.gone = True
            log.info("generate job %d: a chunk could not be delivered (its client left): withdrawn", number)
            if not run.withdrawn:
                self._withdraw(number, run)

    def _overloaded(self, channel: str) -> None:
        """A refusal at the channel's queue limit, counted as the engine counts its own (not accepted)."""
        found = getattr(getattr(self.daemon, "engine", None), "channels", {}).get(channel)
        if found is not None:
            found.stats.overloaded += 1

    def _count(self, channel: str, counter: str, late: bool = False) -> None:
        """Count in the engine's counters of `channel` (accepted, completed...: `dynbatchctl status`)."""
        engine = getattr(self.daemon, "engine", None)
        if engine is not None:
            engine.count_generated(channel, counter, late=late)

    def _answer(self, run: Running, end: P.GenEnd) -> Answer:
        self.ended[end.reason] = self.ended.get(end.reason, 0) + 1
        request = run.pending.request
        total_us = (self.daemon.clock() - run.accepted_ns) // 1000
        workers = getattr(self.daemon.pool, "workers", ())
        device = next((getattr(w, "device", "") for w in workers if w.index == run.worker), "")
        timing = P.Timing(queue_us=max(0, total_us - end.total_us), compute_us=end.total_us, total_us=total_us,
                          batch_size=1, channel=run.channel, device=device,
                          ttft_us=end.ttft_us + max(0, total_us - end.total_us),
                          tpot_us=end.tpot_us, preemptions=end.preemptions)
        if end.reason in ENDED_WELL:
            self.ttft.setdefault(run.channel, Histogram()).record(timing.ttft_us)
            if end.output_tokens > 1:
                self.tpot.setdefault(run.channel, Histogram()).record(end.tpot_us)
            value = {"finish_reason": end.reason, "output_tokens": end.output_tokens,
                     "prompt_tokens": end.prompt_tokens}
            if not request.stream:
                value["text"] = end.text
            return Answer(run.pending, OK, output=(value, None), timing=timing)
        code = CODES.get(end.reason, P.MODEL_ERROR)
        message = end.message or {P.CANCELLED: f"cancelled after {end.output_tokens} tokens",
                                  P.DEADLINE_EXCEEDED: f"deadline passed after {end.output_tokens} tokens"}.get(
                                      code, f"generation ended: {end.reason}")
        return Answer(run.pending, code, message, timing=timing)

    def _finish(self, number: int, answer: Answer) -> None:
        run = self.jobs.pop(number)
        self.in_flight.end(run.channel)
        if run.overdue is not None:
            run.overdue.cancel()
        if counter := COUNTERS.get(answer.code):   # late: a worker's end after the deadline, before its step noticed
            self._count(run.channel, counter, answer.code == OK and bool(run.deadline_ms)
                        and answer.timing.total_us > run.deadline_ms * 1000)
        pending = run.pending
        key = (pending.envelope[0], pending.request.id)
        if (numbers := self.by_client.get(key)) is not None:   # only its own: another under its id stays cancellable
            numbers.remove(number)
            if not numbers:
                del self.by_client[key]
        self.daemon._send((answer,), run.channel)
        if (self.daemon.state == "draining" and not self.jobs) or self.daemon.membership.unloading_models:
            self.daemon._schedule_pump()   # the pass that sees the drain settled, or a removed model unloaded


def buckets(hist: Histogram) -> list[list[float]]:
    """[upper edge in seconds, ends at or below it] at BUCKET_EDGES_US, cumulative (Prometheus's
    histogram buckets; the count above the last edge is the total's)."""
    at = dict(hist.cumulative(every=8))
    return [[edge / 1e6, at[float(edge)]] for edge in BUCKET_EDGES_US]
