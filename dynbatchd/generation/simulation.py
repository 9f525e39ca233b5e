"""Simulated generation: a latency model of prefill and decode, workloads, and a fake-clock driver.

A step costs ``step_ms + per_seq_ms × sequences decoding + per_kv_token_ms × KV tokens read +
prefill_ms_per_token × prompt tokens prefilled``: decode is bound by reading the weights once per
step (the fixed part) plus each sequence's KV; prefill by compute per token. In ``static`` mode a
batch is padded: it prefills every member at its longest prompt's length and keeps decoding ended
members until its longest member ends. A channel's ``queue_limit`` refuses a request on arrival
as the daemon does (`InFlight`). Every figure this produces is SIMULATED.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

from dynbatchd.generation.batching import ChannelTargets, Finished, GenerationScheduler, GenRequest, InFlight, StepPlan
from dynbatchd.generation.kv import KVLedger
from dynbatchd.protocol import OVERLOADED   # a request refused on arrival: its channel held its queue_limit
from dynbatchd.simulate.traces import poisson


@dataclass(frozen=True)
class GenerationLatency:
    """Milliseconds per step of a decoder on one device (defaults: a 7B-class model on one GPU)."""
    step_ms: float = 12.0
    per_seq_ms: float = 0.08
    per_kv_token_ms: float = 0.00002
    prefill_ms_per_token: float = 0.06

    def estimate_ms(self, prefill_tokens: int, decoding: int) -> float:
        """What the scheduler may ask before a step: its cost without the KV term."""
        return self.step_ms + self.per_seq_ms * decoding + self.prefill_ms_per_token * prefill_tokens

    def step_cost_ms(self, plan: StepPlan, kv_tokens: int, *, static: bool = False) -> float:
        prefill = (len(plan.prefill) * max(plan.prefill_lengths) if static and plan.prefill
                   else sum(plan.prefill_lengths))
        decoding = len(plan.decode) + plan.held
        return (self.step_ms + self.per_seq_ms * decoding + self.per_kv_token_ms * kv_tokens
                + self.prefill_ms_per_token * prefill)


def mixed_workload(n: int, *, rate_per_s: float, seed: int = 0, channels: tuple[str, ...] = ("standard",),
                   prompt_range: tuple[int, int] = (16, 2048), output_range: tuple[int, int] = (16, 512)
                   ) -> list[GenRequest]:
    """Poisson arrivals; prompt and output lengths log-uniform over their ranges (many short, some long)."""
    rng = random.Random(seed)
    out = []
    for i, t in zip(range(n), poisson(rng, rate_per_s, 0.0, math.inf, unit=1000.0)):
        prompt = round(_log_uniform(rng, *prompt_range))
        output = round(_log_uniform(rng, *output_range))
        out.append(GenRequest(f"r{i}", channels[i % len(channels)], prompt, output, t))
    return out


def k12_workload(n: int, *, rate_per_s: float, seed: int = 0) -> list[GenRequest]:
    """The guide's K12 case: 95% short chat turns (channel "chat"), 5% homework grading with
    10k+ token prompts (channel "grading")."""
    rng = random.Random(seed)
    out = []
    for i, t in zip(range(n), poisson(rng, rate_per_s, 0.0, math.inf, unit=1000.0)):
        if rng.random() < 0.05:
            out.append(GenRequest(f"g{i}", "grading", rng.randint(10_000, 14_000), rng.randint(128, 512), t))
        else:
            out.append(GenRequest(f"c{i}", "chat", rng.randint(16, 256), rng.randint(16, 128), t))
    return out


def _log_uniform(rng: random.Random, low: int, high: int) -> float:
    return low * (high / low) ** rng.random()


@dataclass
class SimulationReport:
    mode: str
    finished: list[Finished]
    duration_ms: float
    steps: int
    preemptions: int
    kv: dict[str, int]
    targets: dict[str, ChannelTargets] = field(default_factory=dict)

    def met(self, f: Finished) -> bool:
        return self.targets[f.channel].met(f.reason, f.ttft_ms, f.tpot_ms)

    @property
    def overloaded(self) -> int:
        return sum(1 for f in self.finished if f.reason == OVERLOADED)

    @property
    def output_tokens(self) -> int:
        return sum(f.output_tokens for f in self.finished)

    @property
    def goodput_tokens_per_s(self) -> float:
        """Output tokens/s of the requests that met their channel's TTFT and TPOT targets."""
        good = sum(f.output_tokens for f in self.finished if self.met(f))
        return good / (self.duration_ms / 1000.0) if self.duration_ms else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / (self.duration_ms / 1000.0) if self.duration_ms else 0.0

    def summary(self) -> dict[str, float | int | str]:
        return {"mode": self.mode, "requests": len(self.finished),
                "met_targets": sum(1 for f in self.finished if self.met(f)),
                "goodput_tokens_per_s": round(self.goodput_tokens_per_s, 1),
                "tokens_per_s": round(self.tokens_per_s, 1), "overloaded": self.overloaded, "steps": self.steps,
                "preemptions": self.preemptions, "kv_peak_bytes": self.kv["kv_peak_bytes"],
                "kv_budget_bytes": self.kv["kv_budget_bytes"], "kv_over_budget": self.kv["kv_over_budget"]}


def simulate_generation(requests: list[GenRequest], channels: dict[str, ChannelTargets], *, mode: str,
                        kv_budget_tokens: int, bytes_per_token: int = 1, latency: GenerationLatency | None = None,
                        max_batch: int = 64, max_prefill_tokens: int = 4096, tpot_guard: bool = False,
                        queue_limits: Mapping[str, int | None] | None = None) -> SimulationReport:
    """Drive a `GenerationScheduler` over `requests` on a fake clock; every token of every request counted.
    `tpot_guard` gives the scheduler the latency model's step estimate, so a lower class's prefill
    waits while it would break a higher class's TPOT (see `dynbatchd.generation.batching`).
    `queue_limits` (channel -> its ``queue_limit``; None or absent: none): a request is refused
    `OVERLOADED` at its arrival when its channel already holds that many, as the daemon refuses it
    before its worker sees it; one arriving during a step still counts that step's ends as held."""
    latency = latency or GenerationLatency()
    ledger = KVLedger(kv_budget_tokens * bytes_per_token, bytes_per_token)
    sched = GenerationScheduler(ledger, channels, mode=mode, max_batch=max_batch,
                                max_prefill_tokens=max_prefill_tokens, step_cost_ms=latency.estimate_ms if tpot_guard else None)
    limits, held, accepted = queue_limits or {}, InFlight(), deque()
    arrivals = [(r.arrival_ms, i, r) for i, r in enumerate(requests)]
    heapq.heapify(arrivals)
    now, finished = 0.0, []

    def arrive(before_ms: float) -> None:
        """Decide each request arrived before `before_ms`: accepted (held) or refused at once."""
        while arrivals and arrivals[0][0] < before_ms:
            r = heapq.heappop(arrivals)[2]
            if held.full(r.channel, limits.get(r.channel)):
                finished.append(Finished(r.id, r.channel, OVERLOADED, 0, r.arrival_ms, None, r.arrival_ms))
            else:
                held.add(r.channel)
                accepted.append(r)

    def ended(ends: list[Finished] | tuple[Finished, ...]) -> None:
        finished.extend(ends)
        for f in ends:
            held.end(f.channel)

    while arrivals or accepted or not sched.idle:
        arrive(math.nextafter(now, math.inf))   # at or before the boundary: after the last step's ends
        while accepted:
            refused = sched.submit(accepted.popleft(), now)
            if refused:
                ended((refused,))
        plan = sched.plan(now)
        ended(plan.ended)
        if plan.empty:
            if not arrivals:
                break
            now = arrivals[0][0]
            continue
        kv_tokens = sum(s.context_tokens for s in sched.running.values())
        now += latency.step_cost_ms(plan, kv_tokens, static=mode == "static")
        arrive(now)                             # arrived during the step: its ends not seen yet
        ended(sched.complete(plan, now))
    start = min((r.arrival_ms for r in requests), default=0.0)
    return SimulationReport(mode, finished, now - start, sched.steps, sched.preemptions, ledger.counters(),
                            dict(channels))
