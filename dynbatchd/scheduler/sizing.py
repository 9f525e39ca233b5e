"""The ``adaptive`` batch sizer: the guide's rule with hysteresis (pure, clock-injected).

The memory model that says how many requests fit lives in `dynbatchd.memory`.
"""

from __future__ import annotations

import math
from typing import Any

from dynbatchd.errors import OptionError
from dynbatchd.scheduler.options import Options
from dynbatchd.scheduler.policies import MS, StaticSizer


def _scaled(limit: int, factor: float, up: bool) -> int:
    x = round(limit * factor, 9)  # 5 × 1.2 is 6.000000000000001 in floating point
    return math.ceil(x) if up else math.floor(x)


class AdaptiveSizer:
    """The guide's rule with hysteresis.

    Each ``observe(utilisation=, memory=, queue_len=, now_ns=)`` (fractions
    0..1 of device busy time and of the memory the daemon's batches need:
    torch's peak allocated, not NVML's "used", see `dynbatchd.observer`;
    the channel's queue length) votes:
    - shrink when utilisation > ``high_util`` (0.90) or memory > ``high_memory`` (0.80);
    - grow when utilisation < ``low_util`` (0.70) and queue_len > ``queue_above`` (10);
    - hold otherwise (the dead band 0.70..0.90 holds, whatever the queue).
    The limit changes only after ``patience`` (3) consecutive identical votes
    and at least ``cooldown_ms`` (1000) after the previous change; a hold or
    an opposite vote resets the count, so alternating signals never move it.
    Shrink: × ``shrink`` (0.8), rounded down, at least 1. Grow: × ``grow``
    (1.2), rounded up (so 1 → 2), at most the ceiling.

    The ceiling starts at ``max_batch`` (default the channel's max_batch).
    ``on_oom(failed_size)`` lowers both the limit and the ceiling below the
    failed size (to min(limit, failed − 1, floor(failed × shrink)), at least
    1), at once and without waiting for hysteresis, so growth never returns
    to a size that did not fit. Start: ``start`` (default the ceiling).
    """

    def __init__(self, max_batch: int, *, start: int | None = None, high_util: float = 0.90,
                 high_memory: float = 0.80, low_util: float = 0.70, queue_above: int = 10, shrink: float = 0.8,
                 grow: float = 1.2, patience: int = 3, cooldown_ms: float = 1000.0):
        self.ceiling = max_batch
        self.limit = min(max_batch, start or max_batch)
        self.high_util, self.high_memory, self.low_util = high_util, high_memory, low_util
        self.queue_above = queue_above
        self.shrink, self.grow = shrink, grow
        self.patience = patience
        self.cooldown_ns = int(cooldown_ms * MS)
        self._vote = "hold"
        self._streak = 0
        self._changed_ns: int | None = None
        self.changes = 0
        self.last_change = ""

    @classmethod
    def factory(cls, channel: str, settings: Any, options: dict[str, Any]) -> "AdaptiveSizer":
        where = f"channels.{channel}.batch_size.options"
        o = Options(where, options, {"max_batch", "start", "high_util", "high_memory", "low_util", "queue_above",
                                     "shrink", "grow", "patience", "cooldown_ms"})
        max_batch = o.count("max_batch", int(settings.max_batch))
        kw = dict(high_util=o.num("high_util", 0.90, lo=0.0, hi=1.0), high_memory=o.num("high_memory", 0.80, lo=0.0, hi=1.0),
                  low_util=o.num("low_util", 0.70, lo=0.0, hi=1.0), queue_above=o.count("queue_above", 10, lo=0),
                  shrink=o.num("shrink", 0.8, lo=0.0, hi=1.0, lo_open=True), grow=o.num("grow", 1.2, lo=1.0),
                  patience=o.count("patience", 3), cooldown_ms=o.num("cooldown_ms", 1000.0, lo=0.0))
        if kw["low_util"] >= kw["high_util"]:
            raise OptionError(f"{where}.low_util", f"{kw['low_util']:g} must be below high_util {kw['high_util']:g}")
        start = o.count("start", max_batch) if "start" in options else None
        return cls(max_batch, start=start, **kw)

    def max_batch(self) -> int:
        return self.limit

    def vote(self, utilisation: float, memory: float, queue_len: int) -> str:
        if utilisation > self.high_util or memory > self.high_memory:
            return "shrink"
        if utilisation < self.low_util and queue_len > self.queue_above:
            return "grow"
        return "hold"

    def observe(self, *, utilisation: float, memory: float, queue_len: int, now_ns: int) -> None:
        vote = self.vote(utilisation, memory, queue_len)
        self._streak = self._streak + 1 if vote == self._vote else 1
        self._vote = vote
        if vote == "hold" or self._streak < self.patience:
            return
        if self._changed_ns is not None and now_ns - self._changed_ns < self.cooldown_ns:
            return
        if vote == "shrink":
            new = max(1, _scaled(self.limit, self.shrink, up=False))
        else:
            new = min(self.ceiling, max(self.limit, _scaled(self.limit, self.grow, up=True)))
        if new != self.limit:
            self.limit = new
            self.changes += 1
            self.last_change = vote
            self._changed_ns = now_ns
        self._streak = 0

    def on_oom(self, failed_size: int) -> None:
        below = max(1, min(failed_size - 1, _scaled(failed_size, self.shrink, up=False)))
        self.ceiling = max(1, min(self.ceiling, below))
        if self.limit > below:
            self.limit = below
            self.changes += 1
            self.last_change = "oom"

    def inherit(self, previous: "AdaptiveSizer") -> None:
        """Retuned: keep the ceiling an out-of-memory lowered, and the size reached so far."""
        self.ceiling = min(self.ceiling, previous.ceiling)
        self.limit = max(1, min(self.ceiling, previous.limit))
        self.changes, self.last_change, self._changed_ns = previous.changes, previous.last_change, previous._changed_ns

    def describe(self) -> dict[str, Any]:
        return {"policy": "adaptive", "max_batch": self.limit, "ceiling": self.ceiling,
                "last_change": self.last_change, "changes": self.changes}


def factories() -> dict[str, Any]:
    """Name → factory of every built-in batch-size policy (``static`` lives in
    `dynbatchd.scheduler.policies`), for the built-in sizing plugin and `build_channels`."""
    return {"static": StaticSizer.factory, "adaptive": AdaptiveSizer.factory}
