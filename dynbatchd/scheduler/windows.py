"""Adaptive wait-window policies: ``ewma``, ``pattern``, ``tiered`` and ``slo``.

Each is a plain object with the `WindowPolicy` protocol of
`dynbatchd.scheduler.policies`: ``on_arrival`` per accepted request,
``on_batch_done`` per finished batch, ``window_ns(now, lane)`` whenever the
scheduler asks whether a lane's batch is ready (it is ready once
``lane.opened_ns + window`` has passed), and ``describe()`` for status. Times
are integer nanoseconds from the scheduler's injected clock; nothing here
reads wall time. A policy sees every arrival of its channel (all lanes
together), so rates and spreads are per channel.

Options come from ``[channels.NAME.window] options = {...}``; an unknown or
out-of-range option is a ValueError naming the key, like any config error.
The channel's ``window_ms`` bounds every window (the scheduler enforces it,
since compliance rules and the operator's latency budget rely on it); the
factories apply the same bound, so ``describe()`` shows the window in force: a
configured figure above ``window_ms`` acts as ``window_ms``.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from dynbatchd.scheduler.options import Options
from dynbatchd.scheduler.policies import MS, LaneState

SECOND = 1_000_000_000


def _where(channel: str) -> str:
    return f"channels.{channel}.window.options"


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
            raise ValueError(f"{o.where}.min_ms: {min_ms:g} is above the largest window {max_ms:g} "
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

DEFAULT_TIERS = (  # the guide's K12 windows: short → realtime, medium → standard, long → bulk
    {"below_tokens": 512, "window_ms": 30.0},
    {"below_tokens": 8192, "window_ms": 100.0},
    {"window_ms": 500.0},
)
_TIER_KEYS = {"tokens": "below_tokens", "queued": "below_queued"}


class TieredWindow:
    """A window per tier of the lane's waiting requests, for mixed traffic.

    ``tiers`` is a list checked in order; the first tier whose bound is above
    the lane's measure gives the window, and the last tier has no bound (the
    catch-all). All bounded tiers use the same measure:

    - ``below_tokens``: the *mean tokens per waiting request* of the lane
      (lane.tokens / lane.queued), i.e. a request-size tier: a lane of short
      requests gets a short window, a lane of long ones may wait to batch.
    - ``below_queued``: the number of requests waiting in the lane, i.e. a
      queue-depth tier (e.g. wait longer while a batch is nearly empty).

    Default (the guide's K12 channels): mean < 512 tokens → 30 ms,
    < 8192 → 100 ms, else 500 ms, each at most the channel's window_ms.
    Bounds must increase strictly.
    """

    def __init__(self, tiers: list[tuple[float | None, float]], by: str = "tokens", cap_ms: float | None = None):
        self.by = by
        self.tiers = [(bound, int(min(window_ms, cap_ms if cap_ms is not None else window_ms) * MS))
                      for bound, window_ms in tiers]

    @classmethod
    def parse_tiers(cls, raw: Any, where: str, cap_ms: float | None = None) -> "TieredWindow":
        if not isinstance(raw, (list, tuple)) or not raw:
            raise ValueError(f"{where}: expected a non-empty list of tiers, e.g. "
                             "[{below_tokens = 512, window_ms = 20}, {window_ms = 100}]")
        tiers: list[tuple[float | None, float]] = []
        by = None
        for i, tier in enumerate(raw):
            at = f"{where}[{i}]"
            if not isinstance(tier, dict):
                raise ValueError(f"{at}: expected a table such as {{below_tokens = 512, window_ms = 20}}")
            o = Options(at, tier, {"window_ms", *_TIER_KEYS.values()})
            if "window_ms" not in tier:
                raise ValueError(f"{at}.window_ms: required")
            window_ms = o.num("window_ms", 0.0, lo=0.0)
            bounds = [m for m, key in _TIER_KEYS.items() if key in tier]
            if len(bounds) > 1:
                raise ValueError(f"{at}: give one of below_tokens or below_queued, not both")
            last = i == len(raw) - 1
            if not bounds:
                if not last:
                    raise ValueError(f"{at}: only the last tier may have no bound (it is the catch-all)")
                tiers.append((None, window_ms))
                continue
            measure = bounds[0]
            if by is not None and measure != by:
                raise ValueError(f"{at}: all tiers must use the same bound ({_TIER_KEYS[by]})")
            by = measure
            bound = o.num(_TIER_KEYS[measure], 0.0, lo=0.0)
            if tiers and bound <= tiers[-1][0]:
                raise ValueError(f"{at}.{_TIER_KEYS[measure]}: bounds must increase, {bound:g} follows {tiers[-1][0]:g}")
            if last:
                raise ValueError(f"{at}: the last tier must have no bound (the catch-all)")
            tiers.append((bound, window_ms))
        return cls(tiers, by or "tokens", cap_ms)

    @classmethod
    def factory(cls, channel: str, settings: Any, options: dict[str, Any]) -> "TieredWindow":
        Options(_where(channel), options, {"tiers"})
        return cls.parse_tiers(options.get("tiers", [dict(t) for t in DEFAULT_TIERS]), f"{_where(channel)}.tiers",
                               float(settings.window_ms))

    def measure(self, lane: LaneState) -> float:
        if self.by == "queued":
            return float(lane.queued)
        return lane.tokens / lane.queued if lane.queued else 0.0

    def on_arrival(self, now_ns: int, tokens: int) -> None:
        pass

    def on_batch_done(self, size: int, tokens: int, compute_ns: int, now_ns: int) -> None:
        pass

    def window_ns(self, now_ns: int, lane: LaneState) -> int:
        value = self.measure(lane)
        for bound, window in self.tiers:
            if bound is None or value < bound:
                return window
        raise AssertionError("the last tier is a catch-all")  # pragma: no cover

    def describe(self) -> dict[str, Any]:
        return {"policy": "tiered", "by": self.by, "tiers_ms": [window / MS for _, window in self.tiers]}


# ---------------------------------------------------------------------------
# pattern
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
            raise ValueError(f"{where}.steady_ratio: must be >= 1, got {kw['steady_ratio']:g}")
        if kw["burst_ratio"] < kw["steady_ratio"]:
            raise ValueError(f"{where}.burst_ratio: {kw['burst_ratio']:g} is below steady_ratio {kw['steady_ratio']:g}")
        if kw["burst_cv"] < kw["steady_cv"]:
            raise ValueError(f"{where}.burst_cv: {kw['burst_cv']:g} is below steady_cv {kw['steady_cv']:g}")
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

class SloWindow:
    """Wait for more requests only while it lowers their expected latency and every deadline holds.

    Inputs: the channel's learned cost curve (``lane.cost``: t(n) ≈ a + p·n,
    with p including the per-token cost at the mean tokens per arrival) and
    the channel's arrival rate λ (arrivals counted with weight e^(−age/T),
    T = ``rate_horizon_ms``, divided by T; it decays during silence).

    The rule. With q requests waiting and a device slot free, compare
    "dispatch q now and run the next k arrivals in a second batch" against
    "wait for k more (k/λ) and run q + k together". Summing completion times
    over those q + k requests (with k/λ no longer than the current batch
    would take), waiting wins by k·(a − q·p − (q + k)/λ): the fixed cost a of
    a separate batch against the extra wait imposed on the queue. The best
    wait is w* = (a − q·(p + 1/λ)) / 2; when w* ≤ 0 the batch closes now.
    So a lone request at low traffic goes at once, while a fast stream on a
    device with a large fixed cost is gathered for a few milliseconds; under
    overload batches fill by size while the device is busy.

    Near saturation (arrivals at GATHER_FROM or more of what full batches
    serve) that rule alone would keep the device flat out on small batches,
    each paying the fixed cost a, so that any jitter makes it fall behind and
    refuse work. There it also waits for the batch that keeps the device
    busy only ``headroom`` of the time (option, default 0.85; 0 turns it
    off): n = λ·a / (headroom − λ·p), or max_batch where none does
    (`keeping_up_batch`). The deadline and max_wait bounds below still hold.

    The wait is anchored at the channel's latest arrival (an expected arrival
    that does not come ends it) and never ends later than:
    - the earliest deadline − t(expected batch) − ``margin_ms`` (default 5);
    - the oldest request's arrival + ``max_wait_ms`` (default and at most
      the channel's window_ms);
    - the moment the batch would be full at rate λ.
    With no free slot the window is 0: the lane is re-decided when a slot frees.
    If the scheduler provides ``lane.device_busy_ns`` (time until a device can
    start the batch), waiting until ``lead_ms`` before then is free and is taken.
    """

    def __init__(self, *, max_wait_ms: float, margin_ms: float = 5.0, rate_horizon_ms: float = 250.0,
                 lead_ms: float = 1.0, headroom: float | None = 0.85):
        self.headroom = headroom    # None: latency alone decides, even near saturation
        self.max_wait_ns = int(max_wait_ms * MS)
        self.margin_ns = int(margin_ms * MS)
        self.horizon_ns = rate_horizon_ms * MS
        self.lead_ns = int(lead_ms * MS)
        self._weight = 0.0          # decayed arrival count at _last_arrival
        self._last_arrival: int | None = None
        self._tokens = 0.0          # decayed token count, for the mean tokens per arrival

    @classmethod
    def factory(cls, channel: str, settings: Any, options: dict[str, Any]) -> "SloWindow":
        o = Options(_where(channel), options, {"max_wait_ms", "margin_ms", "rate_horizon_ms", "lead_ms", "headroom"})
        cap = float(settings.window_ms)
        headroom = o.num("headroom", 0.85, lo=0.0, hi=1.0)
        return cls(max_wait_ms=min(cap, o.num("max_wait_ms", cap, lo=0.0)),
                   margin_ms=o.num("margin_ms", 5.0, lo=0.0),
                   rate_horizon_ms=o.num("rate_horizon_ms", 250.0, lo=0.0, lo_open=True),
                   lead_ms=o.num("lead_ms", 1.0, lo=0.0), headroom=headroom or None)

    def inherit(self, previous: "SloWindow") -> None:
        """Retuned: keep the arrival-rate estimate."""
        self._weight, self._last_arrival, self._tokens = previous._weight, previous._last_arrival, previous._tokens

    def on_arrival(self, now_ns: int, tokens: int) -> None:
        decay = self._decay(now_ns)
        self._weight = self._weight * decay + 1.0
        self._tokens = self._tokens * decay + tokens
        self._last_arrival = now_ns if self._last_arrival is None else max(self._last_arrival, now_ns)

    def on_batch_done(self, size: int, tokens: int, compute_ns: int, now_ns: int) -> None:
        pass

    def _decay(self, now_ns: int) -> float:
        if self._last_arrival is None:
            return 0.0
        return math.exp(-max(0, now_ns - self._last_arrival) / self.horizon_ns)

    def rate_per_ns(self, now_ns: int) -> float:
        """Arrivals per nanosecond, as seen at `now_ns`."""
        return self._weight * self._decay(now_ns) / self.horizon_ns

    def mean_tokens(self) -> float:
        return self._tokens / self._weight if self._weight > 0 else 0.0

    GATHER_FROM = 0.7   # the keeping-up batch applies once the arrivals are this share of what full batches serve

    def keeping_up_batch(self, rate: float, base: float, per_request: float, max_batch: int) -> int:
        """The smallest batch with which the device serves `rate` (requests per ns) busy only
        `headroom` of the time: n with rate·(base + per_request·n)/n = headroom; `max_batch` when
        none does; 0 (no such rule) while the rate is under GATHER_FROM of what full batches
        serve, or with no headroom set. Near saturation, work-conserving small batches pay the fixed cost `base` so
        often that the device runs flat out and any jitter makes it fall behind, at a rate that
        bigger batches serve with room to spare."""
        headroom = self.headroom
        if headroom is None or rate * (base + per_request * max_batch) < self.GATHER_FROM * max_batch:
            return 0   # far from saturation: latency alone decides
        load = rate * per_request
        if load >= headroom:
            return max_batch
        return min(max_batch, math.ceil(rate * base / (headroom - load)))

    def window_ns(self, now_ns: int, lane: LaneState) -> int:
        if lane.free_slots <= 0 or lane.queued >= lane.max_batch or lane.queued <= 0:
            return 0
        rate = self.rate_per_ns(now_ns)
        if rate <= 0.0:
            return 0
        base, per_item, per_token = lane.cost.coefficients()
        per_request = per_item + per_token * self.mean_tokens()
        q = lane.queued
        gap = 1.0 / rate
        wait = (base - q * (per_request + gap)) / 2.0
        target = self.keeping_up_batch(rate, base, per_request, lane.max_batch)
        if q < target:   # near saturation: gather the batch the device keeps up with, with headroom
            wait = max(wait, (target - q) * gap)
        wait = min(wait, (lane.max_batch - q) * gap)       # no point waiting past a full batch
        anchor = self._last_arrival if self._last_arrival is not None else now_ns
        end = anchor + int(wait) if wait > 0 else now_ns
        busy = getattr(lane, "device_busy_ns", 0)
        if busy > self.lead_ns:
            end = max(end, now_ns + busy - self.lead_ns)   # the batch could not start earlier anyway
        if end <= now_ns:
            return 0
        expected = min(lane.max_batch, q + int((end - now_ns) * rate))
        tokens = lane.tokens + (expected - q) * self.mean_tokens()
        latest = lane.earliest_deadline_ns - lane.cost.estimate_ns(expected, int(tokens)) - self.margin_ns
        end = min(end, latest, lane.opened_ns + self.max_wait_ns)
        if end <= now_ns:
            return 0
        return end - lane.opened_ns

    def describe(self) -> dict[str, Any]:
        return {"policy": "slo", "max_wait_ms": self.max_wait_ns / MS,
                "rate_per_s": round(self._weight / self.horizon_ns * SECOND, 3)}


def factories() -> dict[str, Any]:
    """Name → factory, for the built-in windows plugin."""
    return {"ewma": EwmaWindow.factory, "pattern": PatternWindow.factory,
            "tiered": TieredWindow.factory, "slo": SloWindow.factory}
