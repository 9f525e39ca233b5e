"""What one simulated run did: per request, per batch, and the aggregates reports show.

Every figure here comes from a model of a device, not from hardware: reports
label it SIMULATED. The on-time and goodput figures are `dynbatchd.telemetry`'s,
the same definitions `status` and `/metrics` use.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Sequence

from dynbatchd.simulate.traces import Arrival
from dynbatchd.telemetry import goodput_rps, on_time_fraction

MS = 1_000_000

# Outcomes, as the protocol's reply codes name them.
PENDING, COMPLETED, EXPIRED, OVERLOADED, FAILED = 0, 1, 2, 3, 4
OUTCOME_NAMES = {COMPLETED: "completed", EXPIRED: "deadline_exceeded", OVERLOADED: "overloaded",
                 FAILED: "model_error"}


@dataclass(slots=True)
class BatchRecord:
    """One batch as the simulated device ran it."""
    id: int
    channel: str
    device: int
    size: int
    tokens: int
    formed_ns: int
    start_ns: int
    end_ns: int
    compute_ns: int
    max_batch: int
    oom: bool = False
    tenants: tuple = ()


@dataclass(slots=True)
class GroupStats:
    """Outcomes of one class (or channel) of requests over a span of arrival times."""
    offered: int = 0
    completed: int = 0
    on_time: int = 0
    late: int = 0
    expired: int = 0
    overloaded: int = 0
    failed: int = 0
    span_s: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    p99_completed_ms: float = 0.0
    p99_success_ms: float = 0.0     # a request not completed counts as +inf: dropping cannot improve it
    max_ms: float = 0.0

    @property
    def goodput_rps(self) -> float:
        """Requests answered successfully within their SLO, per second of the span."""
        return goodput_rps(self.on_time, self.span_s)

    @property
    def on_time_fraction(self) -> float:
        """As `status` defines it (`telemetry.on_time_fraction`): overloaded and expired are misses."""
        return on_time_fraction(self.on_time, self.offered)

    def as_dict(self) -> dict[str, Any]:
        return {"offered": self.offered, "completed": self.completed, "on_time": self.on_time,
                "late": self.late, "expired": self.expired, "overloaded": self.overloaded,
                "failed": self.failed, "goodput_rps": round(self.goodput_rps, 3),
                "on_time_fraction": round(self.on_time_fraction, 6), "p50_ms": round(self.p50_ms, 3),
                "p99_ms": round(self.p99_ms, 3), "p99_completed_ms": round(self.p99_completed_ms, 3),
                "p99_success_ms": round(self.p99_success_ms, 3) if math.isfinite(self.p99_success_ms) else None,
                "max_ms": round(self.max_ms, 3), "simulated": True}


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of an ascending sequence (0 when empty)."""
    if not sorted_values:
        return 0.0
    return sorted_values[max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))]


def _success_quantile(completed_sorted: Sequence[int], offered: int, q: float) -> float:
    """Quantile (ms) of time to a successful answer, every request not completed counting as +inf."""
    if not offered:
        return 0.0
    rank = max(1, math.ceil(q * offered))
    return completed_sorted[rank - 1] / MS if rank <= len(completed_sorted) else math.inf


@dataclass
class SimResult:
    """Everything one simulated run did. All of it is SIMULATED."""
    arrivals: list[Arrival]
    channel_of: list[str]
    outcome: bytearray
    latency_ns: list[int]        # answer time - arrival, per request
    slo_ns: list[int]
    batches: list[BatchRecord]
    devices: int
    end_ns: int
    snapshot: dict[str, dict[str, Any]]
    polls: int = 0

    # -- per-request views ---------------------------------------------------
    def label(self, i: int) -> str:
        a = self.arrivals[i]
        return a.label if a.label is not None else self.channel_of[i]

    def on_time(self, i: int) -> bool:
        return self.outcome[i] == COMPLETED and self.latency_ns[i] <= self.slo_ns[i]

    def counts(self) -> dict[str, int]:
        out = {name: 0 for name in OUTCOME_NAMES.values()}
        for o in self.outcome:
            out[OUTCOME_NAMES[o]] += 1
        return out

    def span(self) -> tuple[int, int]:
        if not self.arrivals:
            return 0, 0
        return self.arrivals[0].at_ns, self.arrivals[-1].at_ns

    # -- aggregates ------------------------------------------------------------
    def stats(self, by: str = "label", start_ns: int | None = None, end_ns: int | None = None
              ) -> dict[str, GroupStats]:
        """Per class (`by="label"`) or per channel (`by="channel"`) for requests arriving in [start, end).

        p99 is taken, like the daemon's latency histogram, over every answered
        request but the `overloaded` ones (answered at once); p99_completed only
        over completed ones. Goodput is on-time completions per second of the span.
        """
        first, last = self.span()
        lo = first if start_ns is None else start_ns
        hi = last + 1 if end_ns is None else end_ns
        span_s = max(hi - lo, 1) / 1e9
        groups: dict[str, GroupStats] = {}
        lats: dict[str, list[int]] = {}
        done: dict[str, list[int]] = {}
        times = [a.at_ns for a in self.arrivals]
        for i in range(bisect.bisect_left(times, lo), bisect.bisect_left(times, hi)):
            key = self.label(i) if by == "label" else self.channel_of[i]
            g = groups.get(key)
            if g is None:
                g = groups[key] = GroupStats(span_s=span_s)
                lats[key], done[key] = [], []
            g.offered += 1
            o = self.outcome[i]
            if o == COMPLETED:
                g.completed += 1
                if self.latency_ns[i] <= self.slo_ns[i]:
                    g.on_time += 1
                else:
                    g.late += 1
                done[key].append(self.latency_ns[i])
            elif o == EXPIRED:
                g.expired += 1
            elif o == OVERLOADED:
                g.overloaded += 1
            else:
                g.failed += 1
            if o != OVERLOADED:
                lats[key].append(self.latency_ns[i])
        for key, g in groups.items():
            ls = sorted(lats[key])
            ds = sorted(done[key])
            g.p50_ms = quantile(ls, 0.50) / MS
            g.p99_ms = quantile(ls, 0.99) / MS
            g.max_ms = (ls[-1] / MS) if ls else 0.0
            g.p99_completed_ms = quantile(ds, 0.99) / MS
            g.p99_success_ms = _success_quantile(ds, g.offered, 0.99)
        return groups

    def total(self, start_ns: int | None = None, end_ns: int | None = None) -> GroupStats:
        """All classes together."""
        per = self.stats("label", start_ns, end_ns)
        first, last = self.span()
        lo = first if start_ns is None else start_ns
        hi = last + 1 if end_ns is None else end_ns
        g = GroupStats(span_s=max(hi - lo, 1) / 1e9)
        for s in per.values():
            for f in ("offered", "completed", "on_time", "late", "expired", "overloaded", "failed"):
                setattr(g, f, getattr(g, f) + getattr(s, f))
        times = [a.at_ns for a in self.arrivals]
        idx = range(bisect.bisect_left(times, lo), bisect.bisect_left(times, hi))
        ls = sorted(self.latency_ns[i] for i in idx if self.outcome[i] != OVERLOADED)
        ds = sorted(self.latency_ns[i] for i in idx if self.outcome[i] == COMPLETED)
        g.p50_ms, g.p99_ms = quantile(ls, 0.5) / MS, quantile(ls, 0.99) / MS
        g.max_ms = ls[-1] / MS if ls else 0.0
        g.p99_completed_ms = quantile(ds, 0.99) / MS
        g.p99_success_ms = _success_quantile(ds, g.offered, 0.99)
        return g

    def utilisation(self, start_ns: int | None = None, end_ns: int | None = None) -> float:
        """Mean fraction of [start, end) the devices spent computing (default: first arrival to the end)."""
        lo = self.span()[0] if start_ns is None else start_ns
        hi = self.end_ns if end_ns is None else end_ns
        if hi <= lo or not self.devices:
            return 0.0
        busy = sum(max(0, min(b.end_ns, hi) - max(b.start_ns, lo)) for b in self.batches)
        return busy / ((hi - lo) * self.devices)

    def mean_batch(self, channel: str | None = None) -> float:
        sel = [b.size for b in self.batches if channel is None or b.channel == channel]
        return sum(sel) / len(sel) if sel else 0.0
