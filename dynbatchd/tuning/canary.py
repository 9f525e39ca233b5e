"""Executor: a canary of a candidate setting against the incumbent, on the same traffic.

`Canary` is pure: it decides which requests the candidate serves (every request whose running
count crosses a multiple of 1/share, so the split is exact and deterministic), adds up what
each arm did, and when the time is up says promote or roll back:

- promote when the candidate is no worse on on-time share (within `margin`) and on p99
  (within `p99_margin`; a miss counts as infinitely late, so an arm that misses more than
  1% has an infinite p99), and better on on-time throughput or on device time per request;
- roll back otherwise, and early, as soon as the candidate has missed `abort_misses` more
  requests than its share of the incumbent's misses would allow (a bad candidate is not left
  to finish its time).

`replay` runs a canary on the daemon's engine on the simulator (a virtual clock): the channel
and a ``CHANNEL~canary`` channel with the candidate's settings share the devices, as they do
in a live canary."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dynbatchd.simulate import SimResult, quantile
from dynbatchd.telemetry import on_time_fraction

PROMOTE, ROLLBACK = "promote", "rollback"
MIN_ANSWERED = 50   # requests the candidate must answer before a verdict other than rollback
CANARY_SUFFIX = "~canary"


@dataclass(slots=True)
class Arm:
    answered: int = 0
    on_time: int = 0
    device_ns: int = 0
    latencies_ns: list[int] = field(default_factory=list)

    def on_time_share(self) -> float:
        return on_time_fraction(self.on_time, self.answered)

    def p99_ms(self) -> float:
        """p99 latency with every miss counted as +inf (as `GroupStats.p99_success_ms`): an arm
        cannot look faster by dropping or expiring what it could not serve in time."""
        return quantile(sorted(self.latencies_ns), 0.99) / 1e6 if self.latencies_ns else 0.0

    def figures(self, weight: float, span_s: float) -> dict[str, Any]:
        p99 = self.p99_ms()
        return {"answered": self.answered, "on_time": round(self.on_time_share(), 5),
                "p99_ms": round(p99, 2) if math.isfinite(p99) else None,
                "goodput_rps_scaled": round(self.on_time / weight / span_s, 3) if span_s > 0 else 0.0,
                "device_ms_per_request": round(self.device_ns / 1e6 / self.answered, 4) if self.answered else 0.0}


def _ms(value: float) -> str:
    return f"{value:.1f} ms" if math.isfinite(value) else "more than the SLO"


@dataclass(slots=True)
class Verdict:
    action: str      # PROMOTE or ROLLBACK
    reason: str
    figures: dict[str, Any]


class Canary:
    """`shadow`: the candidate runs copies of its share while the incumbent serves everything, so
    the incumbent's figures weigh the whole traffic (not 1 - share of it)."""

    def __init__(self, share: float, duration_ns: int, started_ns: int, *, margin: float = 0.002,
                 p99_margin: float = 0.05, abort_misses: int = 20, min_answered: int = MIN_ANSWERED,
                 shadow: bool = False):
        if not 0 < share < 1:
            raise ValueError("the canary share is between 0 and 1 (exclusive)")
        self.share, self.duration_ns, self.started_ns = share, duration_ns, started_ns
        self.rest = 1.0 if shadow else 1 - share   # the incumbent's share of the traffic
        self.margin, self.p99_margin, self.abort_misses, self.min_answered = margin, p99_margin, abort_misses, min_answered
        self.incumbent, self.candidate = Arm(), Arm()
        self._seq = 0
        self.verdict: Verdict | None = None

    def takes_next(self) -> bool:
        """Whether the next request goes to the candidate."""
        self._seq += 1
        return int(self._seq * self.share) > int((self._seq - 1) * self.share)

    def record(self, candidate: bool, on_time: bool, latency_ns: int) -> None:
        arm = self.candidate if candidate else self.incumbent
        arm.answered += 1
        arm.on_time += on_time
        arm.latencies_ns.append(latency_ns if on_time else math.inf)

    def record_batch(self, candidate: bool, device_ns: int) -> None:
        (self.candidate if candidate else self.incumbent).device_ns += device_ns

    def figures(self, now_ns: int) -> dict[str, Any]:
        span = (now_ns - self.started_ns) / 1e9
        return {"share": self.share, "seconds": round(span, 3),
                "candidate": self.candidate.figures(self.share, span),
                "incumbent": self.incumbent.figures(self.rest, span)}

    def decide(self, now_ns: int) -> Verdict | None:
        """The verdict once the time is up (or early, on too many misses); None while it runs."""
        if self.verdict is not None:
            return self.verdict
        c, i = self.candidate, self.incumbent
        allowed = (i.answered - i.on_time) * self.share / self.rest
        if (c.answered - c.on_time) - allowed >= self.abort_misses:
            return self._end(ROLLBACK, f"the candidate missed {c.answered - c.on_time} requests, "
                             f"{self.abort_misses}+ more than its share of the incumbent's misses ({allowed:.0f})", now_ns)
        if now_ns - self.started_ns < self.duration_ns:
            return None
        if c.answered < self.min_answered:
            return self._end(ROLLBACK, f"the candidate answered only {c.answered} requests "
                             f"(needs {self.min_answered} to judge)", now_ns)
        f = self.figures(now_ns)
        fc, fi = f["candidate"], f["incumbent"]
        if c.on_time_share() < i.on_time_share() - self.margin:
            return self._end(ROLLBACK, f"on time {100 * fc['on_time']:.2f}% against the incumbent's "
                             f"{100 * fi['on_time']:.2f}%", now_ns)
        if c.p99_ms() > i.p99_ms() * (1 + self.p99_margin):
            return self._end(ROLLBACK, f"p99 {_ms(c.p99_ms())} against the incumbent's {_ms(i.p99_ms())} "
                             "(misses count as infinitely late)", now_ns)
        more = c.on_time / self.share > i.on_time / self.rest * 1.001
        cheaper = c.device_ns / max(c.answered, 1) < i.device_ns / max(i.answered, 1) * 0.98
        if not (more or cheaper):
            return self._end(ROLLBACK, "no worse, but not better on on-time throughput or device time per request",
                             now_ns)
        return self._end(PROMOTE, "no worse on on-time share and p99, better on "
                         + ("on-time throughput" if more else "device time per request"), now_ns)

    def _end(self, action: str, reason: str, now_ns: int) -> Verdict:
        self.verdict = Verdict(action, reason, self.figures(now_ns))
        return self.verdict


def replay(canary: Canary, channel: str, incumbent: Any, candidate: Any, arrivals: list, model: Any,
           **sim_kw: Any) -> tuple[Verdict, SimResult]:
    """Run `canary` on the engine on the simulator; the verdict is taken in arrival order, so an early
    rollback is taken at the (virtual) time it would be live."""
    twin = channel + CANARY_SUFFIX

    def route(a: Any) -> str:
        return twin if canary.takes_next() else channel

    result = model.run({channel: incumbent, twin: candidate}, arrivals, route=route, **sim_kw)
    for r in result.batches:
        canary.record_batch(r.channel == twin, r.compute_ns)
    order = sorted(range(len(result.arrivals)), key=lambda k: result.arrivals[k].at_ns + result.latency_ns[k])
    for k in order:
        done = result.arrivals[k].at_ns + result.latency_ns[k]
        canary.record(result.channel_of[k] == twin, result.on_time(k),
                      result.latency_ns[k])
        verdict = canary.decide(done)
        if verdict is not None:
            return verdict, result
    end = max(canary.started_ns + canary.duration_ns, result.end_ns)
    return canary.decide(end) or canary._end(ROLLBACK, "the traffic ended before the canary's time", end), result
