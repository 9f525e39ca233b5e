"""Counters, latency histograms and the derived figures operators watch: fill rate, scheduling
efficiency, health. Pure arithmetic: NVML (the one driver read) is in `dynbatchd.nvml`.

Nothing here records payloads: only counts, sizes and times (data minimisation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any

# Log-spaced buckets: 8 per doubling, from 1 µs up to ~1.1e9 µs (about 18 minutes).
_PER_DOUBLING = 8
_BUCKETS = 30 * _PER_DOUBLING + 1


class Histogram:
    """Latency histogram in microseconds: O(1) record, ~9% bucket resolution."""

    __slots__ = ("counts", "total", "sum_us", "max_us")

    def __init__(self) -> None:
        self.counts = [0] * _BUCKETS
        self.total = 0
        self.sum_us = 0.0
        self.max_us = 0.0

    def record(self, us: float) -> None:
        self.record_all((us,))

    def record_all(self, values: Sequence[float]) -> None:
        """Each of `values` (a batch's latencies: one call, not one per request)."""
        counts, top, log2, per = self.counts, _BUCKETS - 1, math.log2, _PER_DOUBLING
        for us in values:
            counts[0 if us <= 1.0 else min(top, int(log2(us) * per) + 1)] += 1
        if values:
            self.total += len(values)
            self.sum_us += sum(values)
            self.max_us = max(self.max_us, max(values))

    def quantile(self, q: float) -> float:
        """Upper edge of the bucket holding quantile q (0..1); 0 when empty."""
        if not self.total:
            return 0.0
        rank = max(1, math.ceil(q * self.total))
        seen = 0
        for idx, count in enumerate(self.counts):
            seen += count
            if seen >= rank:
                return min(self.max_us, 2.0 ** (idx / _PER_DOUBLING))
        return self.max_us

    def mean(self) -> float:
        return self.sum_us / self.total if self.total else 0.0

    def add(self, other: "Histogram") -> "Histogram":
        """This histogram plus `other`, as a new one."""
        out = Histogram()
        out.counts = [a + b for a, b in zip(self.counts, other.counts)]
        out.total, out.sum_us = self.total + other.total, self.sum_us + other.sum_us
        out.max_us = max(self.max_us, other.max_us)
        return out

    def cumulative(self, every: int = 4) -> list[tuple[float, int]]:
        """(upper edge in µs, requests at or below it) at every `every`-th bucket edge, as
        Prometheus histogram buckets want them (cumulative, increasing)."""
        out, seen = [], 0
        for idx, count in enumerate(self.counts):
            seen += count
            if idx % every == 0:
                out.append((2.0 ** (idx / _PER_DOUBLING), seen))
        return out


class LatencyRecorder:
    """Latency since start, and over the last 30 to 60 seconds (what `status` should show:
    a lifetime p99 hides today's spike behind yesterday's calm). A latency is recorded once,
    in the current period (this runs per request); the lifetime is the periods added up."""

    __slots__ = ("_retired", "_current", "_previous")

    def __init__(self) -> None:
        self._retired = Histogram()    # every period before the previous one
        self._current = Histogram()
        self._previous = Histogram()

    def record(self, us: float) -> None:
        self._current.record(us)

    def record_all(self, values: Sequence[float]) -> None:
        self._current.record_all(values)

    def rotate(self) -> None:
        """Start a new period (the daemon calls this every 30 s): the recent window drops the oldest."""
        self._retired = self._retired.add(self._previous)
        self._previous, self._current = self._current, Histogram()

    def recent(self) -> Histogram:
        return self._previous.add(self._current)

    @property
    def lifetime(self) -> Histogram:
        return self._retired.add(self.recent())


class SchedulingPasses:
    """How long the daemon's scheduling passes that cut batches took (`Engine.step`, wall time in
    the daemon). A device's queued slot opens `[devices] queue_lead_ms` before it frees and a
    pass then cuts its batch: a pass slower than that leaves the device waiting for the daemon,
    which the simulator cannot show (its clock stands still while the engine plans). Plans of
    long backlogs are where it shows (docs/benchmarks.md, "The device waited for the plan"), so
    the queued slot opens as early as the slowest of about the last ten passes took (`counted`).
    Counts and sums only: this runs on the daemon's hot path, every pass that dispatches."""

    __slots__ = ("lead_ns", "passes", "total_ns", "over_lead", "max_ns", "recent_ns")

    RECENT_DECAY = 0.9   # per pass: a slow pass fades by a tenth with each one after it

    def __init__(self, lead_ns: int) -> None:
        self.lead_ns = lead_ns
        self.passes = self.total_ns = self.over_lead = self.max_ns = self.recent_ns = 0

    def counted(self, ns: int) -> int:
        """Count a pass of `ns`; the lead a queued slot should open with now (at least the
        configured one)."""
        self.passes += 1
        self.total_ns += ns
        if ns > self.lead_ns:
            self.over_lead += 1
            self.max_ns = max(self.max_ns, ns)
        self.recent_ns = max(ns, int(self.recent_ns * self.RECENT_DECAY))
        return max(self.lead_ns, self.recent_ns)

    def snapshot(self) -> dict[str, Any]:
        n = self.passes
        return {"passes": n, "seconds": round(self.total_ns / 1e9, 6), "over_lead": self.over_lead,
                "lead_ms": self.lead_ns / 1e6, "mean_ms": round(self.total_ns / n / 1e6, 3) if n else 0.0,
                "max_ms": round(self.max_ns / 1e6, 3), "opens_ms": round(max(self.lead_ns, self.recent_ns) / 1e6, 3)}


# -- the figures: one definition each, for status, /metrics, simulate and the benchmarks ------

def on_time_fraction(on_time: int, offered: int) -> float:
    """Requests answered successfully within their deadline, over every request offered:
    an `overloaded`, expired or failed request is a miss (shedding load never scores)."""
    return on_time / offered if offered else 1.0


def goodput_rps(on_time: int, span_s: float) -> float:
    """On-time successful answers per second."""
    return on_time / span_s if span_s > 0 else 0.0


def fill_rate(fill_sum: float, batches: int) -> float:
    """Mean of size / max_batch over the batches cut (warmup batches are not counted)."""
    return fill_sum / batches if batches else 0.0


def scheduling_efficiency(compute_ns: int, wait_ns: int) -> float:
    """Share of a dispatched request's time spent computing rather than waiting to be batched."""
    busy = compute_ns + wait_ns
    return compute_ns / busy if busy else 0.0


@dataclass(slots=True)
class ChannelStats:
    accepted: int = 0
    overloaded: int = 0
    refused: int = 0
    expired: int = 0          # answered deadline_exceeded without running
    late: int = 0             # ran, but answered after the deadline
    completed: int = 0
    failed: int = 0
    batches: int = 0
    batched_items: int = 0
    fill_sum: float = 0.0     # sum over batches of size / max_batch
    wait_ns: int = 0          # queue wait summed over dispatched requests
    compute_ns: int = 0       # batch compute time summed over dispatched requests
    cache_hits: int = 0       # answered from the result cache: no latency, no batch
    cancelled: int = 0        # withdrawn by their client while queued
    cost_disputed: int = 0    # refusals not made: the learned cost overestimated the measured one by far
    warmup_batches: int = 0   # warmup work, kept out of fill and latency
    warmup_items: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)   # live batches by size
    latency: LatencyRecorder = field(default_factory=LatencyRecorder)

    def on_time(self) -> int:
        return self.completed - self.late + self.cache_hits

    def offered(self) -> int:
        """Requests answered so far, but the refused (a policy's verdict) and the cancelled (the client's)."""
        return self.completed + self.cache_hits + self.expired + self.failed + self.overloaded

    def on_time_fraction(self) -> float:
        return on_time_fraction(self.on_time(), self.offered())

    def snapshot(self, depth: int, max_batch: int, policy: dict[str, Any]) -> dict[str, Any]:
        return {
            "queue_depth": depth,
            "max_batch": max_batch,
            "accepted": self.accepted,
            "completed": self.completed,
            "batches": self.batches,
            "mean_batch": self.batched_items / self.batches if self.batches else 0.0,
            "fill_rate": fill_rate(self.fill_sum, self.batches),
            **_quantiles_ms(self.latency.recent()),
            "lifetime": _quantiles_ms(self.latency.lifetime),
            "rejected": {"overloaded": self.overloaded, "refused": self.refused},
            "deadline_misses": self.expired + self.late,
            "expired": self.expired,
            "late": self.late,
            "failed": self.failed,
            "on_time": self.on_time_fraction(),
            "on_time_count": self.on_time(),
            "offered": self.offered(),
            "scheduling_efficiency": scheduling_efficiency(self.compute_ns, self.wait_ns),
            "cache_hits": self.cache_hits,
            "cancelled": self.cancelled,
            "cost_disputed": self.cost_disputed,
            "batch_sizes": dict(self.batch_sizes), "compute_s": self.compute_ns / 1e9, "wait_s": self.wait_ns / 1e9,
            "fill_sum": self.fill_sum, "batched_items": self.batched_items,
            "warmup": {"batches": self.warmup_batches, "items": self.warmup_items},
            "window": policy,
        }


def _quantiles_ms(h: Histogram) -> dict[str, float]:
    return {"p50_ms": h.quantile(0.50) / 1000, "p99_ms": h.quantile(0.99) / 1000, "p999_ms": h.quantile(0.999) / 1000}


@dataclass(slots=True)
class DeviceStats:
    """What the engine counts per device (the process side, pid and restarts, is the pool's)."""
    name: str
    inflight: int = 0
    batches: int = 0
    items: int = 0
    busy_ns: int = 0
    since_ns: int = 0
    batch_memory: dict[int, int] = field(default_factory=dict)   # feeder -> its last batch's peak allocated bytes

    def snapshot(self, now_ns: int) -> dict[str, Any]:
        span = now_ns - self.since_ns
        return {"device": self.name, "inflight": self.inflight, "batches": self.batches, "items": self.items,
                "busy_fraction": min(1.0, self.busy_ns / span) if span > 0 else 0.0,
                "busy_s": round(self.busy_ns / 1e9, 6)}   # device time so far: a benchmark's difference of two


def health_score(qps: float, qps_target: float, p99_ms: float, p99_target_ms: float,
                 util: float, mem_headroom: float) -> float:
    """The guide's weighted health score, with each term first normalised to 0..1.

    The guide adds QPS, 1/P99, utilisation and memory headroom raw; their
    units differ, so each is scaled against its target before weighting.
    """
    qps_term = min(1.0, qps / qps_target) if qps_target > 0 else 0.0
    p99_term = 1.0 if p99_ms <= 0 else min(1.0, p99_target_ms / p99_ms)
    return round(0.4 * qps_term + 0.3 * p99_term + 0.2 * min(1.0, max(0.0, util))
                 + 0.1 * min(1.0, max(0.0, mem_headroom)), 4)


def daemon_health(channels: dict[str, dict[str, Any]], deadlines_ms: dict[str, float],
                  devices: list[dict[str, Any]], memory_used: float) -> dict[str, float]:
    """The health score for `status`, from its own channel and device snapshots.

    QPS is taken against its target as the on-time fraction (`on_time_fraction`);
    P99 against the channel's deadline (the worst channel
    counts); utilisation as the devices' mean busy fraction; memory headroom as
    1 − the fullest device's memory use (1 where it is unknown, as on CPU).
    """
    on_time = on_time_fraction(sum(c["on_time_count"] for c in channels.values()),
                               sum(c["offered"] for c in channels.values()))
    worst = min(((deadlines_ms[n], c["p99_ms"]) for n, c in channels.items() if c["p99_ms"] > 0),
                key=lambda pair: pair[0] / pair[1], default=(1.0, 0.0))
    util = sum(d["busy_fraction"] for d in devices) / len(devices) if devices else 0.0
    score = health_score(on_time, 1.0, worst[1], worst[0], util, 1.0 - memory_used)
    return {"score": score, "on_time": round(on_time, 6), "p99_over_deadline": round(worst[1] / worst[0], 4),
            "utilisation": round(util, 4), "memory_headroom": round(1.0 - memory_used, 4)}


def __getattr__(name: str) -> Any:
    """`telemetry.NvmlProbe`, where callers have always found it, without this module importing
    the NVML one at import time (telemetry is a leaf the scheduler may import)."""
    if name == "NvmlProbe":
        from dynbatchd.nvml import NvmlProbe
        return NvmlProbe
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
