"""``bandit``: a window policy that learns, per traffic level, which (window x close-at size) arm
keeps the most requests on time (an online tuner, SIMULATED figures in docs/adaptive-benchmarks.md).

Arms: windows ``windows`` (fractions of the channel's window_ms; default 0, 1/4, 1/2, 1) times
close-at sizes ``caps`` (fractions of max_batch; default 1/4, 1/2, 1): the batch is cut once the
window is over or that many requests wait. The context is the arrival rate, in buckets of x2. Time
runs in epochs of ``epoch_ms`` (default 500); each epoch plays one arm, and its reward is the
requests its batches finished on time per second (a batch is on time when it ends before its
earliest deadline); the SLO is a constraint: an arm whose epochs kept less than ``target``
(default 0.99) of its requests on time is not chosen again in that context.

Safe by construction: the window never exceeds the channel's window_ms (the largest arm is the
incumbent: ``window_ms``, ``max_batch``) nor the earliest deadline less the batch's expected
cost; a context whose incumbent has not been measured plays the incumbent; an arm is tried
only after the incumbent of its context met the target, and the smaller (safer) arms first;
exploitation plays the best arm that met the target, else the incumbent. Every ``explore``
epochs (default 16) the least-played safe arm is re-tried, so a change of traffic is noticed.

Not shown to help: on every trace measured it ties `slo` and the best fixed setting on on-time
throughput with a higher p99 (ties go to the incumbent); `slo` is the policy to use.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from dynbatchd.errors import OptionError
from dynbatchd.scheduler.options import Options, check_entries
from dynbatchd.scheduler.policies import MS, LaneState
from dynbatchd.scheduler.windowkit import SECOND


class _Stats:
    __slots__ = ("epochs", "reward", "items", "on_time")

    def __init__(self) -> None:
        self.epochs, self.reward, self.items, self.on_time = 0, 0.0, 0, 0

    def add(self, reward: float, items: int, on_time: int) -> None:
        self.epochs += 1
        self.reward += (reward - self.reward) / self.epochs     # the mean reward per epoch
        self.items += items
        self.on_time += on_time

    def safe(self, target: float) -> bool:
        return self.items > 0 and self.on_time >= target * self.items


class BanditWindow:
    def __init__(self, *, window_ms: float, max_batch: int, windows: list[float], caps: list[float],
                 epoch_ms: float = 500.0, target: float = 0.99, explore: int = 16, margin_ms: float = 2.0):
        self.arms = sorted({(min(window_ms, f * window_ms), max(1, min(max_batch, round(c * max_batch))))
                            for f in windows for c in caps})
        self.incumbent = (window_ms, max_batch)
        if self.incumbent not in self.arms:
            self.arms.append(self.incumbent)
        self.cap_ns = int(window_ms * MS)
        self.epoch_ns, self.target, self.explore = int(epoch_ms * MS), target, explore
        self.margin_ns = int(margin_ms * MS)
        self.stats: dict[tuple[int, tuple[float, int]], _Stats] = {}
        self.arm = self.incumbent
        self.context = 0
        self._epoch_start: int | None = None
        self._epochs = 0
        self._arrivals = 0
        self._items = self._on_time = 0
        self._cut: deque[tuple[int, int]] = deque()   # (oldest arrival, earliest deadline) of batches cut
        self._last_opened: int | None = None

    @classmethod
    def factory(cls, channel: str, settings: Any, options: dict[str, Any]) -> "BanditWindow":
        o = Options(f"channels.{channel}.window.options", options,
                    {"windows", "caps", "epoch_ms", "target", "explore", "margin_ms"})
        fractions = _fractions(options.get("windows", [0.0, 0.25, 0.5, 1.0]), f"channels.{channel}.window.options.windows")
        caps = _fractions(options.get("caps", [0.25, 0.5, 1.0]), f"channels.{channel}.window.options.caps")
        return cls(window_ms=float(settings.window_ms), max_batch=int(settings.max_batch), windows=fractions,
                   caps=caps, epoch_ms=o.num("epoch_ms", 500.0, lo=1.0),
                   target=o.num("target", 0.99, lo=0.0, hi=1.0), explore=o.count("explore", 16),
                   margin_ms=o.num("margin_ms", 2.0, lo=0.0))

    def inherit(self, previous: "BanditWindow") -> None:
        """Retuned with the same arms: keep what was learned."""
        if previous.arms == self.arms:
            self.stats = previous.stats

    # -- the epoch -------------------------------------------------------------
    def _tick(self, now_ns: int) -> None:
        if self._epoch_start is None:
            self._epoch_start = now_ns
            return
        span = now_ns - self._epoch_start
        if span < self.epoch_ns:
            return
        rate = self._arrivals * SECOND / span
        if self._items:
            self.stats.setdefault((self.context, self.arm), _Stats()).add(
                self._on_time * SECOND / span, self._items, self._on_time)
        self._epochs += 1
        self.context = int(math.log2(rate)) if rate >= 1 else 0
        self.arm = self.choose(self.context)
        self._epoch_start, self._arrivals, self._items, self._on_time = now_ns, 0, 0, 0

    def choose(self, context: int) -> tuple[float, int]:
        """The arm of the next epoch in `context` (see the module's rules)."""
        def stats(arm):
            return self.stats.get((context, arm))
        home = stats(self.incumbent)
        if home is None or not home.safe(self.target):
            return self.incumbent                       # uncertain, or the incumbent itself misses
        untried = [a for a in self.arms if stats(a) is None]
        if untried:
            return min(untried, key=lambda a: (a[0], -a[1]))   # the shortest windows first
        safe = [a for a in self.arms if stats(a).safe(self.target)]
        if self._epochs % self.explore == 0:
            return min(safe, key=lambda a: stats(a).epochs)
        return max(safe, key=lambda a: (round(stats(a).reward, 1), a == self.incumbent, a[1]))

    # -- the window-policy interface ----------------------------------------------
    def on_arrival(self, now_ns: int, tokens: int) -> None:
        self._tick(now_ns)
        self._arrivals += 1

    def on_batch_done(self, size: int, tokens: int, compute_ns: int, now_ns: int) -> None:
        if self._cut:
            _, deadline = self._cut.popleft()
            self._items += size
            self._on_time += size if now_ns <= deadline else 0
        self._tick(now_ns)

    def window_ns(self, now_ns: int, lane: LaneState) -> int:
        self._tick(now_ns)
        window, cap = self.arm
        if lane.queued >= cap:
            end = 0
        else:
            end = min(int(window * MS), self.cap_ns)
            latest = (lane.earliest_deadline_ns - lane.cost.estimate_ns(cap, lane.tokens) - self.margin_ns
                      - lane.opened_ns)
            end = max(0, min(end, latest))
        if lane.opened_ns + end <= now_ns and lane.opened_ns != self._last_opened:
            self._cut.append((lane.opened_ns, lane.earliest_deadline_ns))   # this lane is cut now
            self._last_opened = lane.opened_ns
        return end

    def describe(self) -> dict[str, Any]:
        return {"policy": "bandit", "window_ms": self.arm[0], "close_at": self.arm[1], "context": self.context,
                "arms": len(self.arms), "learned": len(self.stats)}


def _fractions(value: Any, where: str) -> list[float]:
    check_entries(value, where)
    if not isinstance(value, list) or not value or not all(isinstance(v, (int, float)) and 0 <= v <= 1 for v in value):
        raise OptionError(where, f"expected a non-empty list of fractions between 0 and 1, got {value!r}")
    return [float(v) for v in value]
