"""The worker's generation loop: a `GenerationScheduler` beside the runner that owns the KV.

One per causal-lm model in a worker process (as vLLM's EngineCore holds its scheduler and its
model runner together): the daemon hands it `GenerateJob`s and `GenerateCancel`s, and each `step`
runs one token boundary — evict what the plan preempted, end what expired, prefill the new,
decode the running — and returns the messages for the daemon: one `GenTokens` with each
sequence's new text of the step, and a `GenEnd` per job that ended. Sans-I/O and clock-injected
(milliseconds), so a test drives it with a fake runner and a counter; the worker
(`dynbatchd.devices.worker`) only moves its messages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from dynbatchd import protocol as P
from dynbatchd.devices.execution import WorkerStopping
from dynbatchd.logs import LineBudget
from dynbatchd.generation.batching import ChannelTargets, Finished, GenerationScheduler, GenRequest
from dynbatchd.generation.kv import KVLedger, kv_budget_tokens_of

DEFAULT_KV_BUDGET_TOKENS = 32768
# The runner options this loop reads ([models.NAME] of a causal-lm model; dynbatchd.toml(5)).
LOOP_OPTIONS = ("kv_budget_tokens", "max_batch_sequences", "max_prefill_tokens", "mode", "tpot_guard")
NO_TARGET_MS = 1e12   # a channel without ttft_ms / tpot_ms: no due time from it

log = logging.getLogger("dynbatchd")
failed_step_lines = LineBudget()   # a line a failing step, per how it failed: a broken model fails every step


@dataclass(frozen=True)
class StepFailed:
    """A sequence the model could not run even alone: it ends with an error (a runner's event's shape)."""
    seq_id: str
    error: str
    text: str = ""
    finished: str = "error"


def _warn(kind: str, message: str, *args: Any) -> None:
    """A warning within `failed_step_lines`' budget for `kind`; those left out counted into the next."""
    if (more := failed_step_lines.admit(kind)) is not None:
        log.warning(message + "%s", *args, more)


class StepCost:
    """What a step costs on this device, learnt from the loop's own steps (the TPOT guard's
    estimate): an average of decode-only steps, plus an average per prefill token of the steps
    with prefill beyond that. 0 until both were seen, so the guard holds nothing back blind."""

    def __init__(self, weight: float = 0.2):
        self.weight, self.decode_ms, self.prefill_token_ms = weight, None, None

    def observe(self, prefill_tokens: int, decoding: int, ms: float) -> None:
        if not prefill_tokens:
            self.decode_ms = ms if self.decode_ms is None else self.decode_ms + self.weight * (ms - self.decode_ms)
        elif self.decode_ms is not None:
            per = max(0.0, ms - (self.decode_ms if decoding else 0.0)) / prefill_tokens
            old = self.prefill_token_ms
            self.prefill_token_ms = per if old is None else old + self.weight * (per - old)

    def estimate_ms(self, prefill_tokens: int, decoding: int) -> float:
        if self.decode_ms is None or self.prefill_token_ms is None:
            return 0.0
        return self.decode_ms + prefill_tokens * self.prefill_token_ms


def scheduler_for(options: dict[str, Any], cost: StepCost | None = None) -> GenerationScheduler:
    """A model's scheduler from its runner options; the KV budget is counted in tokens. `cost`:
    the TPOT guard's step-cost estimate (with ``tpot_guard``; the loop teaches it)."""
    ledger = KVLedger(budget_bytes=int(options.get("kv_budget_tokens", DEFAULT_KV_BUDGET_TOKENS)), bytes_per_token=1)
    return GenerationScheduler(ledger, {}, mode=options.get("mode", "continuous"),
                               max_batch=int(options.get("max_batch_sequences", 64)),
                               max_prefill_tokens=int(options.get("max_prefill_tokens", 4096)),
                               step_cost_ms=cost.estimate_ms if cost is not None else None)


def kv_budget_for(runner: Any) -> int:
    """The live KV budget in tokens: the ``kv_budget_tokens`` option, else the planner's formula
    (`dynbatchd.generation.kv.kv_budget_tokens_of`: device memory less 20% headroom, the weights and
    a reserve) on the CUDA device's total memory, else DEFAULT_KV_BUDGET_TOKENS (a CPU's memory is not
    the model's to plan)."""
    options = runner.options
    if "kv_budget_tokens" in options:
        return int(options["kv_budget_tokens"])
    dtype = None if options.get("dtype", "auto") == "auto" else options["dtype"]
    tokens = kv_budget_tokens_of(options.get("path"), device_total_bytes(getattr(runner, "device", "cpu")), dtype=dtype)
    return tokens if tokens is not None else DEFAULT_KV_BUDGET_TOKENS


def device_total_bytes(device: str) -> int:
    """A CUDA device's total memory (torch), 0 for anything else."""
    if not str(device).startswith("cuda"):
        return 0
    import torch

    return int(torch.cuda.get_device_properties(device).total_memory)


def loop_for(runner: Any, clock: Callable[[], float]) -> "GenerationLoop":
    """The loop for `runner`'s model, configured by its options (`LOOP_OPTIONS`)."""
    cost = StepCost() if runner.options.get("tpot_guard", False) else None
    options = {**runner.options, "kv_budget_tokens": kv_budget_for(runner)}
    return GenerationLoop(runner, scheduler_for(options, cost), clock, cost)


class GenerationLoop:
    """Generate jobs for one model: `take`, `cancel`, then `step` while `busy`."""

    def __init__(self, runner: Any, scheduler: GenerationScheduler, clock: Callable[[], float],
                 cost: StepCost | None = None):
        self.runner, self.scheduler, self.clock, self.cost = runner, scheduler, clock, cost
        self.jobs: dict[str, P.GenerateJob] = {}
        self.taken_ms: dict[str, float] = {}
        self.errors: list[P.GenEnd] = []   # jobs refused before the scheduler saw them
        self.untold: dict[str, int] = {}   # tokens generated with no text sent yet, by sequence

    @property
    def busy(self) -> bool:
        return bool(self.errors) or not self.scheduler.idle

    def take(self, job: P.GenerateJob) -> None:
        """Queue a job; one that can never fit the KV budget, or whose prompt the runner refuses,
        ends at the next `step` (too_large / bad_request)."""
        now, key = self.clock(), str(job.job)
        opts = job.options
        try:
            seq = self.runner.add(key, job.prompt, max_new_tokens=opts.get("max_new_tokens"), stop=opts.get("stop"),
                                  temperature=opts.get("temperature"), top_k=opts.get("top_k"), seed=opts.get("seed"))
        except Exception as exc:   # (an empty prompt after tokenising): the client's input
            self.errors.append(P.GenEnd(job.job, "bad_request", message=f"{type(exc).__name__}: {exc}"[:300]))
            return
        # the config's priority goes higher first, the scheduler's classes lower first; each job
        # carries its channel's settings, so a reload's new targets apply from its next job
        targets = ChannelTargets(job.channel, -job.priority, job.ttft_ms or NO_TARGET_MS, job.tpot_ms or NO_TARGET_MS)
        if self.scheduler.channels.get(job.channel) != targets:
            self.scheduler.channels[job.channel] = targets
        deadline = None if job.deadline_ms is None else now + job.deadline_ms
        self.jobs[key], self.taken_ms[key] = job, now
        ended = self.scheduler.submit(GenRequest(key, job.channel, len(seq.prompt_ids), seq.max_new_tokens, now,
                                                 deadline), now)
        if ended is not None:
            self.errors.append(self._end(ended))

    def cancel(self, job: int, reason: str = P.CANCELLED) -> P.GenEnd | None:
        """End a job now and free its KV (its end message; None: it already ended)."""
        ended = self.scheduler.cancel(str(job), self.clock())
        if ended is None:
            return None
        end = self._end(ended)
        end.reason = reason
        return end

    def step(self) -> list[Any]:
        """One token boundary: the messages for the daemon (GenTokens first, then GenEnds). The ends
        made before the forward stay in `errors` until returned, so a step that raises loses none."""
        plan = self.scheduler.plan(self.clock())
        for seq_id in plan.preempted:
            self.runner.preempt(seq_id)
        self.errors.extend(self._end(end) for end in plan.ended)
        if plan.empty:
            out, self.errors = self.errors, []
            return out
        started = self.clock()
        events = self._run(self.runner.prefill, plan.prefill) + self._run(self.runner.decode_step, plan.decode)
        if self.cost is not None and not any(isinstance(e, StepFailed) for e in events):
            self.cost.observe(sum(plan.prefill_lengths), len(plan.decode), self.clock() - started)
        failed = [self._failed(e) for e in events if e.finished == "error"]   # first: complete skips them
        tokens = []
        for e in events:   # a token whose text is held back (a possible stop string) counts in the next chunk
            if e.finished == "error":
                continue
            job, n = int(e.seq_id), self.untold.pop(e.seq_id, 0) + 1
            if e.text:
                tokens.append((job, e.text, n))
            else:
                self.untold[e.seq_id] = n
        stopped = [e.seq_id for e in events if e.finished == "stop"]
        ends = [self._end(end) for end in self.scheduler.complete(plan, self.clock(), stopped)]
        out, self.errors = self.errors, []
        return ([P.GenTokens(tokens)] if tokens else []) + out + [end for end in failed if end] + ends

    def _run(self, call: Callable[[Any], Any], seq_ids: tuple[str, ...]) -> list[Any]:
        """The runner's `call` (prefill or decode_step) over `seq_ids`; when the model raises, each
        sequence again alone, so that one the model cannot run ends alone and the others of its step
        go on (one prompt past the vocabulary failed every stream of the model), as a failing batch
        is split. Any exception of the model's counts, but the worker's own stop. (Called with no
        sequences too, as before: a runner may count a step's fixed cost there.)"""
        try:
            return list(call(seq_ids))
        except BaseException as exc:   # (the worker's own catch is Exception: SystemExit ended it)
            if isinstance(exc, WorkerStopping):
                raise
            kind = type(exc).__name__   # (not its text: that may quote the input)
            if len(seq_ids) <= 1:
                _warn("alone", "a generation step failed (%s) for %d sequence: it ends alone", kind, len(seq_ids))
                return [StepFailed(seq_id, f"the model failed its step ({kind})") for seq_id in seq_ids]
        _warn("split", "a generation step of %d sequences failed (%s): each runs again alone", len(seq_ids), kind)
        return [event for seq_id in seq_ids for event in self._run(call, (seq_id,))]

    def _failed(self, event: Any) -> P.GenEnd | None:
        """A sequence the runner could not continue (its token failed, or the model's forward over it
        alone) ends alone, as an error; the others of its step go on."""
        end = self.cancel(int(event.seq_id), "error")
        if end is not None:
            end.message = f"generation failed: {event.error or 'its next token failed'}"
        return end

    def _end(self, end: Finished) -> P.GenEnd:
        """The end message of `end`; the runner's sequence (and its KV) goes."""
        job = self.jobs.pop(end.id, None)
        self.untold.pop(end.id, None)
        taken = self.taken_ms.pop(end.id, end.arrival_ms)
        seq = self.runner.remove(end.id)
        reason = "bad_request" if end.reason == "too_large" else end.reason
        message = ""
        if end.reason == "too_large":
            limit = self.scheduler.ledger.budget_bytes
            message = (f"prompt ({len(seq.prompt_ids) if seq else '?'} tokens) + max_new_tokens "
                       f"({seq.max_new_tokens if seq else '?'}) can never fit the KV budget of {limit} tokens")
        us = 1000.0
        ttft, tpot = end.ttft_ms, end.tpot_ms
        return P.GenEnd(int(end.id), reason, end.output_tokens if seq is None else len(seq.generated),
                        len(seq.prompt_ids) if seq else 0, seq.text if seq else "",
                        int(ttft * us) if ttft is not None else 0, int(tpot * us) if tpot is not None else 0,
                        int((end.end_ms - taken) * us), end.preemptions, message,
                        self.scheduler.ledger.in_use_bytes if job is not None or seq is not None else 0)
