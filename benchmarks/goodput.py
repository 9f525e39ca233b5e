"""Goodput: the highest offered rate whose p99 stays under the SLO with < 0.1 % errors.

The search probes upward (or downward) from a starting rate by a constant factor until the
outcome flips, then bisects between the highest pass and the lowest failure. Runs are
short and noisy, so the answer is "the highest rate that passed", with every trial kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from benchmarks.loadgen import RunResult

Trial = tuple[float, RunResult, dict[str, Any]]   # offered rate, result, CPU and other figures


@dataclass
class Search:
    slo_ms: float
    max_error_rate: float
    trials: list[Trial] = field(default_factory=list)

    def passed(self, result: RunResult) -> bool:
        return result.passes(self.slo_ms, self.max_error_rate)

    @property
    def best(self) -> Trial | None:
        good = [t for t in self.trials if self.passed(t[1])]
        return max(good, key=lambda t: t[0]) if good else None

    @property
    def goodput(self) -> float:
        best = self.best
        return best[0] if best else 0.0


def find_goodput(measure: Callable[[float], tuple[RunResult, dict[str, Any]]], *, slo_ms: float, start: float,
                 factor: float = 1.25, probes: int = 4, refine: int = 2, ceiling: float | None = None,
                 max_error_rate: float = 0.001, log: Callable[[str], None] = print) -> Search:
    """Probe from `start` by `factor` (at most `probes` runs), then bisect `refine` times.

    `ceiling` caps every offered rate (e.g. a little above a known hardware limit).
    """
    search = Search(slo_ms, max_error_rate)

    def trial(rate: float) -> bool:
        rate = round(rate, 1)
        result, extra = measure(rate)
        search.trials.append((rate, result, extra))
        ok = search.passed(result)
        log(f"    {rate:>9.1f} req/s offered ({result.sent_rps:>9.1f} sent) -> {result.achieved_rps:>9.1f} ok/s  p99 {result.p99_ms:>9.2f} ms  "
            f"errors {result.error_count:>5}  batch {result.mean_batch:>5.1f}  {'PASS' if ok else 'fail'}")
        return ok

    lo = hi = None  # highest pass, lowest failure
    rate = min(start, ceiling) if ceiling else start
    going_up = trial(rate)
    lo, hi = (rate, None) if going_up else (None, rate)
    for _ in range(probes - 1):
        nxt = rate * factor if going_up else rate / factor
        if ceiling and nxt > ceiling:
            nxt = ceiling
            if nxt <= rate:
                break
        rate = nxt
        if trial(rate):
            lo = rate
            if not going_up:
                break
        else:
            hi = rate
            if going_up:
                break
    if lo is None or hi is None:
        return search
    for _ in range(refine):
        mid = (lo + hi) / 2
        if trial(mid):
            lo = mid
        else:
            hi = mid
    return search
