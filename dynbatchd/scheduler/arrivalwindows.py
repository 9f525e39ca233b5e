"""Window policies that follow the arrival gaps: ``ewma`` (the smoothed inter-arrival gap) and
``pattern`` (burst / steady / mixed classes). Rules shared by all policies: `dynbatchd.scheduler.windows`.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from dynbatchd.errors import OptionError
from dynbatchd.scheduler.options import Options
from dynbatchd.scheduler.policies import MS, LaneState
from dynbatchd.scheduler.targetwindows import DEFAULT_TIERS, TieredWindow
from dynbatchd.scheduler.windowkit import SECOND, _where


# ---------------------------------------------------------------------------
# ewma
# ---------------------------------------------------------------------------

class EwmaWindow:
    """The guide's EWMA: window ← α·last_interval + (1−α)·window, clamped to [min_ms, max_ms].

    What it tracks: the smoothed *inter-arrival gap* of the channel, so the
    window is "about as long as the next request usually takes to come". At
    high rates the window shrinks (batches fill by size anyway and waiting
    buys nothing); at low rates it grows up to ``max_ms``. It does not track
    how long a whole batch takes to fill. The clamp applies to the stored
    value, so one long idle gap raises the window to ``max_ms`` at most and
    the next few short gaps bring it back down (weight (1−α)^k, halving
    every ~2 arrivals at α = 0.3) instead of leaving it stuck high.

    Options: ``alpha`` (0 < α ≤ 1, default 0.3); ``initial_ms`` (default the
    channel's window_ms); ``min_ms`` (default 1, or window_ms if smaller);
    ``max_ms`` (default and at most the channel's window_ms).
    """

    def __init__(self, initial_ms: float, *, alpha: float = 0.3, min_ms: float = 1.0, max_ms: float | None = None):
        self.alpha = alpha
        self.min_ns = min_ms * MS
        self.max_ns = (max_ms if max_ms is not None else max(initial_ms, min_ms)) * MS
        self._window = self._clamp(initial_ms * MS)
        self._last_arrival: int | None = None
        self.last_interval_ns: int | None = None

    @classmethod
    def factory(cls, channel: str, settings: Any, options: dict[str, Any]) -> "EwmaWindow":
        o = Options(_where(channel), options, {"alpha", "initial_ms", "min_ms", "max_ms"})
        alpha = o.num("alpha", 0.3, lo=0.0, hi=1.0, lo_open=True)
        cap = float(settings.window_ms)
        min_ms = o.num("min_ms", min(1.0, cap), lo=0.0)
        max_ms = min(cap, o.num("max_ms", cap, lo=0.0))
        if max_ms < min_ms:
            raise OptionError(f"{o.where}.min_ms", f"{min_ms:g} is above the largest window {max_ms:g} "
                             "(max_ms, bounded by the channel's window_ms)")
        initial = o.num("initial_ms", float(settings.window_ms), lo=0.0)
        return cls(initial, alpha=alpha, min_ms=min_ms, max_ms=max_ms)

    def _clamp(self, ns: float) -> float:
        return min(self.max_ns, max(self.min_ns, ns))

    def on_arrival(self, now_ns: int, tokens: int) -> None:
        if self._last_arrival is not None:
            interval = max(0, now_ns - self._last_arrival)
            self.last_interval_ns = interval
            self._window = self._clamp(self.alpha * interval + (1.0 - self.alpha) * self._window)
        self._last_arrival = now_ns

    def on_batch_done(self, size: int, tokens: int, compute_ns: int, now_ns: int) -> None:
        pass

    def inherit(self, previous: "EwmaWindow") -> None:
        """Retuned: keep the smoothed gap, clamped to the new bounds."""
        self._window = self._clamp(previous._window)
        self._last_arrival, self.last_interval_ns = previous._last_arrival, previous.last_interval_ns

    def window_ns(self, now_ns: int, lane: LaneState) -> int:
        return round(self._window)

    def describe(self) -> dict[str, Any]:
        return {"policy": "ewma", "window_ms": round(self._window) / MS, "alpha": self.alpha}


# ---------------------------------------------------------------------------
# tiered
# ---------------------------------------------------------------------------


class PatternWindow:
    """Classify the channel's recent traffic as burst, steady or mixed; pick that class's window.

    Over the last ``span_ms`` of arrivals it measures the rate and the
    coefficient of variation (CV = std / mean) of the inter-arrival gaps, and
    compares the rate with a slow baseline (the span rate smoothed with time
    constant ``baseline_ms``). Poisson traffic has CV ≈ 1; clumped arrivals
    have CV well above 1.

    - burst:  rate ≥ ``burst_ratio`` × baseline (a surge), or CV ≥ ``burst_cv``
              → ``burst_ms`` (30): batches fill fast, so keep latency down;
    - steady: CV ≤ ``steady_cv`` and the rate within a factor ``steady_ratio``
              of the baseline, or fewer than ``min_samples`` gaps in the span
              (sparse traffic is no burst) → ``steady_ms`` (150): fill batches;
    - mixed:  anything between → the ``tiers`` of the tiered policy.

    The class is recomputed at most every ``refresh_ms`` and at most the last
    ``max_samples`` arrivals are kept, so its cost per arrival is O(1).
    Windows above the channel's window_ms act as window_ms: give the channel
    ``window_ms = 150`` or more for the guide's steady window to apply.
    """

    def __init__(self, *, span_ms=1000.0, baseline_ms=30000.0, min_samples=8, burst_ratio=2.0, burst_cv=2.0,
                 steady_ratio=1.5, steady_cv=1.25, burst_ms=30.0, steady_ms=150.0, refresh_ms=50.0,
                 max_samples=512, tiers: TieredWindow | None = None, cap_ms: float | None = None):
        self.span_ns = int(span_ms * MS)
        self.baseline_ns = baseline_ms * MS
        self.min_samples = min_samples
        self.burst_ratio, self.burst_cv = burst_ratio, burst_cv
        self.steady_ratio, self.steady_cv = steady_ratio, steady_cv
        if cap_ms is not None:
            burst_ms, steady_ms = min(burst_ms, cap_ms), min(steady_ms, cap_ms)
        self.burst_ns, self.steady_ns = int(burst_ms * MS), int(steady_ms * MS)
        self.refresh_ns = int(refresh_ms * MS)
        self.tiers = tiers or TieredWindow.parse_tiers([dict(t) for t in DEFAULT_TIERS], "tiers", cap_ms)
        self._times: deque[int] = deque(maxlen=max_samples)
        self._at: int | None = None          # when the class was last computed
        self._first: int | None = None       # first arrival seen
        self.traffic = "steady"
        self.rate_per_s = 0.0
        self.baseline_per_s: float | None = None
        self.cv: float | None = None

    @classmethod
    def factory(cls, channel: str, settings: Any, options: dict[str, Any]) -> "PatternWindow":
        where = _where(channel)
        o = Options(where, options, {"span_ms", "baseline_ms", "min_samples", "burst_ratio", "burst_cv",
                                     "steady_ratio", "steady_cv", "burst_ms", "steady_ms", "refresh_ms",
                                     "max_samples", "tiers"})
        kw = {k: o.num(k, d, lo=0.0, lo_open=True) for k, d in (
            ("span_ms", 1000.0), ("baseline_ms", 30000.0), ("burst_ratio", 2.0), ("burst_cv", 2.0),
            ("steady_ratio", 1.5), ("steady_cv", 1.25))}
        for key in ("burst_ms", "steady_ms", "refresh_ms"):
            kw[key] = o.num(key, {"burst_ms": 30.0, "steady_ms": 150.0, "refresh_ms": 50.0}[key], lo=0.0)
        if kw["steady_ratio"] < 1.0:
            raise OptionError(f"{where}.steady_ratio", f"must be >= 1, got {kw['steady_ratio']:g}")
        if kw["burst_ratio"] < kw["steady_ratio"]:
            raise OptionError(f"{where}.burst_ratio", f"{kw['burst_ratio']:g} is below steady_ratio {kw['steady_ratio']:g}")
        if kw["burst_cv"] < kw["steady_cv"]:
            raise OptionError(f"{where}.burst_cv", f"{kw['burst_cv']:g} is below steady_cv {kw['steady_cv']:g}")
        cap = float(settings.window_ms)
        tiers = TieredWindow.parse_tiers(options["tiers"], f"{where}.tiers", cap) if "tiers" in options else None
        return cls(min_samples=o.count("min_samples", 8, lo=2), max_samples=o.count("max_samples", 512, lo=4),
                   tiers=tiers, cap_ms=cap, **kw)

    def on_arrival(self, now_ns: int, tokens: int) -> None:
        """Observing: the arrival joins the sample and the traffic class is brought up to date,
        so asking for a window never changes what the policy knows."""
        if self._first is None:
            self._first = now_ns
        self._times.append(now_ns)
        self.classify(now_ns)

    def on_batch_done(self, size: int, tokens: int, compute_ns: int, now_ns: int) -> None:
        pass

    def classify(self, now_ns: int) -> str:
        """The traffic class at `now_ns` (recomputed at most every refresh_ms)."""
        if self._at is not None and 0 <= now_ns - self._at < self.refresh_ns:
            return self.traffic
        times = self._times
        while times and times[0] < now_ns - self.span_ns:
            times.popleft()
        n = len(times)
        # With a full sample buffer the span is shorter than span_ms: rate over what is held.
        held = self.span_ns if n < (times.maxlen or 0) else max(1, now_ns - times[0])
        self.rate_per_s = n * SECOND / held
        if self.baseline_per_s is None:
            # The baseline starts once a whole span has been watched; until then no surge is claimed.
            if self._first is not None and now_ns - self._first >= self.span_ns:
                self.baseline_per_s = self.rate_per_s
        else:
            dt = max(0, now_ns - (self._at or now_ns))
            self.baseline_per_s += (1.0 - math.exp(-dt / self.baseline_ns)) * (self.rate_per_s - self.baseline_per_s)
        self._at = now_ns
        self.cv = self._cv(times)
        base = self.baseline_per_s
        ratio = 1.0 if base is None else (self.rate_per_s + 1e-9) / (base + 1e-9)
        if self.cv is None:
            self.traffic = "steady"
        elif ratio >= self.burst_ratio or self.cv >= self.burst_cv:
            self.traffic = "burst"
        elif self.cv <= self.steady_cv and 1.0 / self.steady_ratio <= ratio <= self.steady_ratio:
            self.traffic = "steady"
        else:
            self.traffic = "mixed"
        return self.traffic

    def _cv(self, times: deque[int]) -> float | None:
        if len(times) - 1 < self.min_samples:
            return None
        gaps = [b - a for a, b in zip(times, list(times)[1:])]
        mean = sum(gaps) / len(gaps)
        if mean <= 0:
            return math.inf  # every arrival at one instant: as clumped as it gets
        var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
        return math.sqrt(var) / mean

    def window_ns(self, now_ns: int, lane: LaneState) -> int:
        if self.traffic == "burst":
            return self.burst_ns
        if self.traffic == "steady":
            return self.steady_ns
        return self.tiers.window_ns(now_ns, lane)

    def describe(self) -> dict[str, Any]:
        window = {"burst": self.burst_ns, "steady": self.steady_ns}.get(self.traffic)
        return {"policy": "pattern", "traffic": self.traffic,
                "window_ms": window / MS if window is not None else None,
                "rate_per_s": round(self.rate_per_s, 3),
                "cv": None if self.cv is None else round(min(self.cv, 1e9), 3)}


# ---------------------------------------------------------------------------
# slo
# ---------------------------------------------------------------------------
