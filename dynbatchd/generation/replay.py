"""Replay timed generate jobs through the worker's own loop (`GenerationLoop`), open loop.

A job joins when its arrival time has passed on the loop's clock; the loop steps while it is busy
and, when idle, sleeps until the next arrival. The CPU benchmark runs it on the wall clock with the
real runner; the tests run it on a counter clock, so the same code is what both measure. A job's
TTFT counts from its arrival, not from when the loop took it (a long step delays the take). Given
channels' ``queue_limit``s, a job is refused overloaded on arrival as the daemon refuses it before
handing it over (`dynbatchd.generation.batching.InFlight`).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Callable, Mapping

from dynbatchd import protocol as P
from dynbatchd.generation.batching import ENDED_WELL, ChannelTargets, GenRequest, InFlight
from dynbatchd.generation.serving import GenerationLoop


@dataclass(frozen=True)
class TimedJob:
    arrival_ms: float        # since the replay's start
    job: P.GenerateJob


def jobs_from(requests: list[GenRequest], channels: dict[str, ChannelTargets], words: list[str], *,
              seed: int = 0, deadline_ms: Callable[[ChannelTargets], float | None] = lambda c: None
              ) -> list[TimedJob]:
    """Jobs with the requests' arrivals and lengths: a prompt of `prompt_tokens` random words (one
    token each with a word-level tokenizer), greedy, `max_new_tokens` of the request; each carries
    its channel's class and targets (the config's priority is higher first, the scheduler's lower)."""
    rng = random.Random(seed)
    out = []
    for n, r in enumerate(requests):
        c = channels[r.channel]
        job = P.GenerateJob(n, "tiny", " ".join(rng.choices(words, k=r.prompt_tokens)),
                            {"max_new_tokens": r.max_new_tokens}, r.channel, -c.priority, c.ttft_ms, c.tpot_ms,
                            deadline_ms(c))
        out.append(TimedJob(r.arrival_ms, job))
    return out


@dataclass
class RunReport:
    mode: str
    ends: list[P.GenEnd]
    channel_of: dict[int, str]
    lag_ms: dict[int, float]               # arrival to take, per job
    wall_ms: float                         # first arrival to the last end
    targets: dict[str, ChannelTargets]
    preemptions: int = 0
    kv: dict[str, int] = field(default_factory=dict)

    def ttft_ms(self, end: P.GenEnd) -> float:
        return end.ttft_us / 1000 + self.lag_ms.get(end.job, 0.0)

    def met(self, end: P.GenEnd) -> bool:
        """Ended well, within its channel's TTFT (from arrival) and mean TPOT."""
        return self.targets[self.channel_of[end.job]].met(end.reason, self.ttft_ms(end), end.tpot_us / 1000)

    @property
    def met_count(self) -> int:
        return sum(map(self.met, self.ends))

    @property
    def goodput_tokens_per_s(self) -> float:
        """Output tokens/s of the requests that met both targets, over the run's wall time."""
        return sum(e.output_tokens for e in self.ends if self.met(e)) / max(1e-9, self.wall_ms / 1000)

    @property
    def tokens_per_s(self) -> float:
        return sum(e.output_tokens for e in self.ends) / max(1e-9, self.wall_ms / 1000)

    @property
    def overloaded(self) -> int:
        return sum(1 for e in self.ends if e.reason == P.OVERLOADED)

    @property
    def ttft_p50_ms(self) -> float:
        good = [self.ttft_ms(e) for e in self.ends if e.reason in ENDED_WELL]
        return median(good) if good else float("nan")


def replay(loop: GenerationLoop, jobs: list[TimedJob], clock: Callable[[], float],
           sleep: Callable[[float], Any], queue_limits: Mapping[str, int | None] | None = None) -> RunReport:
    """Feed `jobs` to `loop` as their arrivals pass on `clock` (ms), step while busy; every job's
    end. `sleep(ms)` waits for the next arrival while the loop is idle. `queue_limits` (channel ->
    its ``queue_limit``): a job arriving while its channel holds that many ends overloaded at once;
    one arriving during a step still counts that step's ends as held (the daemon hears of them after)."""
    pending = deque(sorted(jobs, key=lambda j: j.arrival_ms))
    channel_of = {j.job.job: j.job.channel for j in jobs}
    limits, held, accepted = queue_limits or {}, InFlight(), deque()
    lag: dict[int, float] = {}
    ends: list[P.GenEnd] = []
    start = clock()
    last = start

    def arrive(now: float, before: bool) -> None:
        while pending and (pending[0].arrival_ms < now if before else pending[0].arrival_ms <= now):
            timed = pending.popleft()
            if held.full(timed.job.channel, limits.get(timed.job.channel)):
                ends.append(P.GenEnd(timed.job.job, P.OVERLOADED))
            else:
                held.add(timed.job.channel)
                accepted.append(timed)

    while pending or accepted or loop.busy:
        now = clock() - start
        arrive(now, before=False)
        while accepted:
            timed = accepted.popleft()
            lag[timed.job.job] = now - timed.arrival_ms
            loop.take(timed.job)
        if not loop.busy:
            if pending:
                sleep(pending[0].arrival_ms - now)
            continue
        messages = loop.step()
        arrive(clock() - start, before=True)
        for msg in messages:
            if isinstance(msg, P.GenEnd):
                ends.append(msg)
                held.end(channel_of[msg.job])
                last = clock()
    mode = loop.scheduler.mode
    return RunReport(mode, ends, channel_of, lag, last - start - min((j.arrival_ms for j in jobs), default=0.0),
                     {c: t for c, t in loop.scheduler.channels.items()}, loop.scheduler.preemptions,
                     loop.scheduler.ledger.counters())
