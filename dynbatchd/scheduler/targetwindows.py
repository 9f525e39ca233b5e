"""Window policies set against a target: ``tiered`` (a window per request-size or queue-depth
tier) and ``slo`` (waits only while a fuller batch lowers expected latency and the earliest deadline
holds). Rules shared by all policies: `dynbatchd.scheduler.windows`.
"""

from __future__ import annotations

import math
from typing import Any

from dynbatchd.errors import OptionError
from dynbatchd.scheduler.options import Options, check_entries
from dynbatchd.scheduler.policies import MS, LaneState
from dynbatchd.scheduler.windowkit import SECOND, _where



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
        check_entries(raw, where)
        if not isinstance(raw, (list, tuple)) or not raw:
            raise OptionError(where, "expected a non-empty list of tiers, e.g. "
                             "[{below_tokens = 512, window_ms = 20}, {window_ms = 100}]")
        tiers: list[tuple[float | None, float]] = []
        by = None
        for i, tier in enumerate(raw):
            at = f"{where}[{i}]"
            if not isinstance(tier, dict):
                raise OptionError(at, "expected a table such as {below_tokens = 512, window_ms = 20}")
            o = Options(at, tier, {"window_ms", *_TIER_KEYS.values()})
            if "window_ms" not in tier:
                raise OptionError(f"{at}.window_ms", "required")
            window_ms = o.num("window_ms", 0.0, lo=0.0)
            bounds = [m for m, key in _TIER_KEYS.items() if key in tier]
            if len(bounds) > 1:
                raise OptionError(at, "give one of below_tokens or below_queued, not both")
            last = i == len(raw) - 1
            if not bounds:
                if not last:
                    raise OptionError(at, "only the last tier may have no bound (it is the catch-all)")
                tiers.append((None, window_ms))
                continue
            measure = bounds[0]
            if by is not None and measure != by:
                raise OptionError(at, f"all tiers must use the same bound ({_TIER_KEYS[by]})")
            by = measure
            bound = o.num(_TIER_KEYS[measure], 0.0, lo=0.0)
            if tiers and bound <= tiers[-1][0]:
                raise OptionError(f"{at}.{_TIER_KEYS[measure]}", f"bounds must increase, {bound:g} follows {tiers[-1][0]:g}")
            if last:
                raise OptionError(at, "the last tier must have no bound (the catch-all)")
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

    Near saturation the rule is work-conserving: a free device takes what
    waits, and batches grow by themselves as the queue does. An opt-in
    near-saturation rule (``headroom`` > 0, off by default) also waits, once
    arrivals reach GATHER_FROM of what full batches serve, for the batch that
    keeps the device busy only ``headroom`` of the time: n = λ·a / (headroom
    − λ·p), or max_batch where none does (`keeping_up_batch`). It is off
    because holding an idle device costs the capacity it means to save: on
    the fake-clock simulator (issue 30, `tests/simulate/test_knee_simulated.py`) it lowered
    goodput at the SLO for every device shape tried (fixed cost 2-20 ms,
    jittered or not). The deadline and max_wait bounds below still hold.

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
                 lead_ms: float = 1.0, headroom: float | None = None):
        self.headroom = headroom    # None (default): latency alone decides, even near saturation
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
        headroom = o.num("headroom", 0.0, lo=0.0, hi=1.0)
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
