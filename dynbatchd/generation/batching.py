"""Continuous (iteration-level) batching, decided at each token boundary, with no clock or I/O.

The driver (the simulator, a runner loop, later the daemon) asks `plan(now)` for the next step,
runs it (prefill the new sequences, decode one token for every running one), then reports it
with `complete(plan, now, stopped)`. Between steps requests join (`submit`) and leave
(`complete`, `cancel`, deadlines). The rules:

- Order: waiting requests go by channel priority (lower first), then the earlier of their
  deadline and their first-token due time (arrival + the channel's `ttft_ms`), then arrival; a
  request that does not fit waits, and nothing behind it jumps it (no starvation of long prompts).
- Admission: a request's worst-case KV (prompt + max_new_tokens) must fit the `KVLedger` beside
  every admitted worst case; a request that could never fit is refused at once (`too_large`).
- Preemption by recompute: when the head of the queue is of a higher class (lower priority
  number) than some running sequences and does not fit, the lowest-class, latest-admitted ones
  are evicted (KV freed) and requeued; they later prefill their prompt plus the tokens they had.
- Prefill and decode share a step; `max_prefill_tokens` caps the prefill a step carries, so that
  running sequences' time per output token stays bounded (a single longer prompt still runs alone).
  Given `step_cost_ms` (an estimate of a step from its prefill tokens and decoding sequences), a
  request's prefill also waits while it would make the step longer than the `tpot_ms` of a
  running sequence of a higher class, until it must start to make its own first-token due
  time: a lower class slows a higher one's tokens only when it would otherwise miss its TTFT.
- Deadlines: a request still waiting or running at its deadline ends `deadline_exceeded` and
  frees its KV at once, as does `cancel`.
- ``mode="static"`` is request-level batching, kept for comparison: a batch is admitted only when
  the device is idle, nobody joins it, and it holds its slots and KV until its longest member ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from dynbatchd.generation.kv import KVLedger

MODES = ("continuous", "static")


ENDED_WELL = ("length", "stop")   # the reasons a generation ends with its answer (not cut short)


@dataclass(frozen=True)
class ChannelTargets:
    """A channel's class and latency targets: time to first token, time per output token."""
    name: str
    priority: int = 0
    ttft_ms: float = 2000.0
    tpot_ms: float = 200.0

    def met(self, reason: str, ttft_ms: float | None, tpot_ms: float | None) -> bool:
        """Whether a request that ended for `reason` with these timings counts as goodput: ended
        well, within both targets (the simulator's and the CPU replay's one definition)."""
        return (reason in ENDED_WELL and ttft_ms is not None and tpot_ms is not None
                and ttft_ms <= self.ttft_ms and tpot_ms <= self.tpot_ms)


class InFlight:
    """A channel's generate jobs in flight (handed to a worker, not yet ended: waiting or
    generating), against its ``queue_limit``: the daemon's hand-over refuses one more as
    overloaded (`dynbatchd.generating.Generations.start`), and the simulators count the same way."""

    def __init__(self) -> None:
        self.per_channel: dict[str, int] = {}

    def full(self, channel: str, limit: int | None) -> bool:
        return limit is not None and self.per_channel.get(channel, 0) >= limit

    def add(self, channel: str) -> None:
        self.per_channel[channel] = self.per_channel.get(channel, 0) + 1

    def end(self, channel: str) -> None:
        self.per_channel[channel] -= 1


@dataclass(frozen=True)
class GenRequest:
    id: str
    channel: str
    prompt_tokens: int
    max_new_tokens: int
    arrival_ms: float = 0.0
    deadline_ms: float | None = None     # absolute; None: no deadline


@dataclass(frozen=True)
class Finished:
    """One request's end: why, how many tokens it produced, and its timings."""
    id: str
    channel: str
    reason: str                 # length, stop, cancelled, deadline_exceeded, too_large
    output_tokens: int
    arrival_ms: float
    first_token_ms: float | None
    end_ms: float
    preemptions: int = 0

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_ms is None else self.first_token_ms - self.arrival_ms

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first (0 for a one-token answer)."""
        if self.first_token_ms is None:
            return None
        return (self.end_ms - self.first_token_ms) / max(1, self.output_tokens - 1)


@dataclass
class Sequence:
    request: GenRequest
    priority: int
    ttft_ms: float = float("inf")
    tpot_ms: float = float("inf")
    generated: int = 0
    first_token_ms: float | None = None
    admitted_at: int = 0                 # admission order, for choosing preemption victims
    preemptions: int = 0
    needs_prefill: bool = True
    done_reason: str | None = None       # static mode: ended, still holding its slot

    @property
    def context_tokens(self) -> int:
        """What a (re)compute prefill runs over: the prompt and the tokens already produced."""
        return self.request.prompt_tokens + self.generated

    @property
    def worst_case_tokens(self) -> int:
        return self.request.prompt_tokens + self.request.max_new_tokens

    def order_key(self) -> tuple:
        deadline = self.request.deadline_ms if self.request.deadline_ms is not None else float("inf")
        due = min(deadline, self.request.arrival_ms + self.ttft_ms)
        return (self.priority, due, self.request.arrival_ms, self.request.id)


@dataclass(frozen=True)
class StepPlan:
    """One iteration: who prefills (and over how many tokens), who decodes, who was evicted."""
    prefill: tuple[str, ...] = ()
    prefill_lengths: tuple[int, ...] = ()
    decode: tuple[str, ...] = ()
    preempted: tuple[str, ...] = ()
    held: int = 0                        # static: ended members still padding the batch
    ended: tuple[Finished, ...] = ()     # expired before the step

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def batch_size(self) -> int:
        return len(self.prefill) + len(self.decode) + self.held


@dataclass
class GenerationScheduler:
    ledger: KVLedger
    channels: dict[str, ChannelTargets]
    mode: str = "continuous"
    max_batch: int = 64
    max_prefill_tokens: int = 4096
    step_cost_ms: Callable[[int, int], float] | None = None   # (prefill tokens, decoding) -> ms
    waiting: dict[str, Sequence] = field(default_factory=dict)
    running: dict[str, Sequence] = field(default_factory=dict)
    steps: int = 0
    preemptions: int = 0
    held_for_tpot: int = 0
    _admissions: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")

    # -- requests in and out --------------------------------------------------------------
    def submit(self, request: GenRequest, now_ms: float) -> Finished | None:
        """Queue a request; a request whose worst case could never fit ends at once (`too_large`)."""
        if request.id in self.waiting or request.id in self.running:
            raise ValueError(f"request {request.id!r} is already queued")
        channel = self.channels[request.channel]
        seq = Sequence(request, channel.priority, channel.ttft_ms, channel.tpot_ms)
        if not self.ledger.ever_fits(seq.worst_case_tokens):
            self.ledger.refused += 1
            return self._ended(seq, "too_large", now_ms)
        self.waiting[request.id] = seq
        return None

    def cancel(self, request_id: str, now_ms: float) -> Finished | None:
        """End a request now (client cancel, disconnect) and free its KV at once."""
        seq = self.waiting.pop(request_id, None) or self.running.pop(request_id, None)
        if seq is None:
            return None
        self.ledger.release(request_id)
        return self._ended(seq, "cancelled", now_ms)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # -- one iteration ----------------------------------------------------------------------
    def plan(self, now_ms: float) -> StepPlan:
        ended = self._expire(now_ms)
        if self.mode == "static":
            self._end_static_batch()
            return self._plan_static(ended)
        preempted = self._admit_continuous(now_ms)
        return self._make_plan(ended, preempted)

    def complete(self, plan: StepPlan, now_ms: float, stopped: Iterable[str] = ()) -> list[Finished]:
        """Each sequence of `plan` still running produced one token at `now_ms`; `stopped` hit a stop."""
        self.steps += 1
        stopped = set(stopped)
        finished = []
        for seq_id in (*plan.prefill, *plan.decode):
            seq = self.running.get(seq_id)
            if seq is None or seq.done_reason:
                continue                  # cancelled or expired meanwhile
            seq.needs_prefill = False
            seq.generated += 1
            if seq.first_token_ms is None:
                seq.first_token_ms = now_ms
            reason = "stop" if seq_id in stopped else "length" if seq.generated >= seq.request.max_new_tokens else None
            if reason is None:
                continue
            if self.mode == "static":
                seq.done_reason = reason
                finished.append(self._ended(seq, reason, now_ms))
            else:
                del self.running[seq_id]
                self.ledger.release(seq_id)
                finished.append(self._ended(seq, reason, now_ms))
        self._end_static_batch()
        return finished

    def _end_static_batch(self) -> None:
        """Static mode: free a batch whose members have all ended (it ends with its longest). Also
        where its last live member expired: the ended ones held the batch, and no waiting request
        was ever admitted again (in the simulator, 191 of 400 requests never answered)."""
        if self.mode == "static" and self.running and all(s.done_reason for s in self.running.values()):
            for seq_id in list(self.running):
                self.ledger.release(seq_id)
            self.running.clear()

    # -- the rules ---------------------------------------------------------------------------
    def _expire(self, now_ms: float) -> tuple[Finished, ...]:
        ended = []
        for table in (self.waiting, self.running):
            for seq_id, seq in list(table.items()):
                deadline = seq.request.deadline_ms
                if deadline is not None and now_ms >= deadline and not seq.done_reason:
                    del table[seq_id]
                    self.ledger.release(seq_id)
                    ended.append(self._ended(seq, "deadline_exceeded", now_ms))
        return tuple(ended)

    def _admit(self, seq: Sequence) -> bool:
        if not self.ledger.reserve(seq.request.id, seq.worst_case_tokens):
            return False
        del self.waiting[seq.request.id]
        self._admissions += 1
        seq.admitted_at = self._admissions
        seq.needs_prefill = True
        self.running[seq.request.id] = seq
        return True

    def _admit_continuous(self, now_ms: float) -> tuple[str, ...]:
        preempted: list[str] = []
        prefill_tokens = sum(s.context_tokens for s in self.running.values() if s.needs_prefill)
        for seq in sorted(self.waiting.values(), key=Sequence.order_key):
            if prefill_tokens and prefill_tokens + seq.context_tokens > self.max_prefill_tokens:
                break
            if self._slows_a_higher_class(seq, prefill_tokens + seq.context_tokens, now_ms):
                self.held_for_tpot += 1
                break
            if len(self.running) >= self.max_batch or not self.ledger.fits(seq.worst_case_tokens):
                victims = self._victims_for(seq)
                if victims is None:
                    self.ledger.refused += 1      # it waits: counted once per step it is turned away
                    break
                for victim in victims:
                    self._preempt(victim)
                    preempted.append(victim.request.id)
            if not self._admit(seq):
                break
            prefill_tokens += seq.context_tokens
        return tuple(preempted)

    def _slows_a_higher_class(self, seq: Sequence, prefill_tokens: int, now_ms: float) -> bool:
        """Whether a step with `prefill_tokens` of prefill would outlast the TPOT target of a
        running sequence of a higher class than `seq` while `seq` can still wait for its first
        token (never without `step_cost_ms`)."""
        if self.step_cost_ms is None:
            return False
        decoding = [s for s in self.running.values() if not s.needs_prefill and not s.done_reason]
        tightest = min((s.tpot_ms for s in decoding if s.priority < seq.priority), default=float("inf"))
        step = self.step_cost_ms(prefill_tokens, len(decoding))
        return step > tightest and now_ms + step < seq.request.arrival_ms + seq.ttft_ms

    def _victims_for(self, seq: Sequence) -> list[Sequence] | None:
        """The fewest lower-class running sequences (lowest class, newest first) whose eviction
        makes room for `seq`; None when even all of them would not."""
        lower = sorted((s for s in self.running.values() if s.priority > seq.priority),
                       key=lambda s: (-s.priority, -s.admitted_at))
        free = self.ledger.budget_bytes - self.ledger.in_use_bytes
        need = self.ledger.need(seq.worst_case_tokens)
        slots = self.max_batch - len(self.running)
        chosen: list[Sequence] = []
        for victim in lower:
            if free >= need and slots >= 1:
                break
            chosen.append(victim)
            free += self.ledger.reserved.get(victim.request.id, 0)
            slots += 1
        return chosen if free >= need and slots >= 1 else None

    def _preempt(self, seq: Sequence) -> None:
        del self.running[seq.request.id]
        self.ledger.release(seq.request.id)
        seq.preemptions += 1
        seq.needs_prefill = True
        self.preemptions += 1
        self.waiting[seq.request.id] = seq

    def _plan_static(self, ended: tuple[Finished, ...]) -> StepPlan:
        if not self.running:
            for seq in sorted(self.waiting.values(), key=Sequence.order_key):
                if len(self.running) >= self.max_batch or not self._admit(seq):
                    break
        return self._make_plan(ended, ())

    def _make_plan(self, ended: tuple[Finished, ...], preempted: tuple[str, ...]) -> StepPlan:
        prefill = [s for s in self.running.values() if s.needs_prefill and not s.done_reason]
        decode = [s for s in self.running.values() if not s.needs_prefill and not s.done_reason]
        held = sum(1 for s in self.running.values() if s.done_reason)
        return StepPlan(tuple(s.request.id for s in prefill), tuple(s.context_tokens for s in prefill),
                        tuple(s.request.id for s in decode), preempted, held, ended)

    @staticmethod
    def _ended(seq: Sequence, reason: str, now_ms: float) -> Finished:
        r = seq.request
        return Finished(r.id, r.channel, reason, seq.generated, r.arrival_ms, seq.first_token_ms, now_ms,
                        seq.preemptions)
