"""The two pluggable decisions of a channel: how long to wait, and how big a batch.

Policies are plain objects built per channel by factories that plugins
register (hooks ``dynbatchd_window_policies`` / ``dynbatchd_batch_sizers``).
They see times in integer nanoseconds from the scheduler's injected clock and
never touch sockets, processes or wall time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

MS = 1_000_000  # nanoseconds per millisecond


@dataclass(slots=True)
class LaneState:
    """What a window policy may look at when asked for the current window."""
    queued: int            # requests waiting in this lane
    tokens: int            # their total tokens
    max_batch: int         # the current batch-size limit
    opened_ns: int         # arrival of the oldest waiting request
    earliest_deadline_ns: int
    free_slots: int        # device slots free right now (0: a batch would wait anyway)
    cost: "CostModel"      # learned compute time per batch
    device_busy_ns: int = 0  # until a device with a free slot could start this batch (0: one is idle)


class WindowPolicy(Protocol):
    """A policy may also define ``inherit(previous)``: when a channel is retuned (tune,
    reload) without changing its policy or options, the freshly built policy takes
    over what the previous one learned instead of starting cold."""
    def on_arrival(self, now_ns: int, tokens: int) -> None: ...
    def on_batch_done(self, size: int, tokens: int, compute_ns: int, now_ns: int) -> None: ...
    def window_ns(self, now_ns: int, lane: LaneState) -> int: ...
    def describe(self) -> dict[str, Any]: ...


class BatchSizer(Protocol):
    def max_batch(self) -> int: ...
    def observe(self, *, utilisation: float, memory: float, queue_len: int, now_ns: int) -> None: ...
    def on_oom(self, failed_size: int) -> None: ...
    def describe(self) -> dict[str, Any]: ...


class FixedWindow:
    """Wait a constant window from the oldest request's arrival (the channel's window_ms)."""

    def __init__(self, window_ms: float):
        self._window_ns = int(window_ms * MS)

    @classmethod
    def factory(cls, channel: str, settings: Any, options: dict[str, Any]) -> "FixedWindow":
        return cls(float(options.get("window_ms", settings.window_ms)))

    def on_arrival(self, now_ns: int, tokens: int) -> None:
        pass

    def on_batch_done(self, size: int, tokens: int, compute_ns: int, now_ns: int) -> None:
        pass

    def window_ns(self, now_ns: int, lane: LaneState) -> int:
        return self._window_ns

    def describe(self) -> dict[str, Any]:
        return {"policy": "fixed", "window_ms": self._window_ns / MS}


class StaticSizer:
    """The channel's configured max_batch, lowered (never raised) after an out-of-memory."""

    def __init__(self, max_batch: int):
        self._limit = max_batch
        self.oom_ceiling: int | None = None   # learned: the largest size that may still fit

    @classmethod
    def factory(cls, channel: str, settings: Any, options: dict[str, Any]) -> "StaticSizer":
        return cls(int(options.get("max_batch", settings.max_batch)))

    def max_batch(self) -> int:
        return self._limit

    def observe(self, *, utilisation: float, memory: float, queue_len: int, now_ns: int) -> None:
        pass

    def on_oom(self, failed_size: int) -> None:
        self._limit = max(1, min(self._limit, failed_size // 2))
        self.oom_ceiling = self._limit

    def inherit(self, previous: "StaticSizer") -> None:
        """Retuned: a size that did not fit before still does not."""
        if previous.oom_ceiling is not None:
            self.oom_ceiling = previous.oom_ceiling
            self._limit = min(self._limit, previous.oom_ceiling)

    def describe(self) -> dict[str, Any]:
        return {"policy": "static", "max_batch": self._limit}


class CostModel:
    """Online estimate of a batch's compute time: t ≈ base + per_item·n + per_token·tokens.

    Fitted by exponentially-forgotten least squares over (n, tokens) so it
    follows a device that warms up or slows down. Until it has seen two
    different batch sizes it answers with the mean time seen (or zero).
    """

    def __init__(self, forget: float = 0.98):
        self.forget = forget
        self._s = [0.0] * 10  # sums: w, n, k, t, nn, nk, kk, nt, kt, tt
        self.samples = 0
        self._coef = (0.0, 0.0, 0.0)
        # Read per request, so kept as plain attributes by `observe`:
        self.settled = False       # timed enough batches to be trusted to refuse work (SETTLED_AFTER)
        self.tokens_matter = True  # a request's tokens may cost device time (until a settled fit says not)

    def observe(self, size: int, tokens: int, compute_ns: int) -> None:
        f = self.forget
        n, k, t = float(size), float(tokens), float(compute_ns)
        s = self._s
        for i, v in enumerate((1.0, n, k, t, n * n, n * k, k * k, n * t, k * t, t * t)):
            s[i] = s[i] * f + v
        self.samples += 1
        self._coef = self._fit()
        self.settled = self.samples >= self.SETTLED_AFTER
        self.tokens_matter = self._coef[2] > 0 or not self.settled

    SETTLED_AFTER = 20   # batches timed before the fit is trusted to refuse work (a young fit can be far off)

    def coefficients(self) -> tuple[float, float, float]:
        """(base_ns, per_item_ns, per_token_ns), never negative."""
        return self._coef

    def _fit(self) -> tuple[float, float, float]:
        w, n, k, t, nn, nk, kk, nt, kt, _ = self._s
        if w <= 0:
            return 0.0, 0.0, 0.0
        mn, mk, mt = n / w, k / w, t / w
        vnn, vnk, vkk = nn / w - mn * mn, nk / w - mn * mk, kk / w - mk * mk
        cnt, ckt = nt / w - mn * mt, kt / w - mk * mt
        det = vnn * vkk - vnk * vnk
        if vnn <= 1e-9:  # one batch size seen so far: no slope to fit
            return mt, 0.0, 0.0
        if abs(det) <= 1e-9 * max(1.0, vnn * vkk) or vkk <= 1e-9:
            per_item, per_token = cnt / vnn, 0.0
        else:
            per_item = (cnt * vkk - ckt * vnk) / det
            per_token = (ckt * vnn - cnt * vnk) / det
        per_item, per_token = max(0.0, per_item), max(0.0, per_token)
        base = max(0.0, mt - per_item * mn - per_token * mk)
        return base, per_item, per_token

    def estimate_ns(self, size: int, tokens: int = 0) -> int:
        base, per_item, per_token = self._coef
        return int(base + per_item * size + per_token * tokens)
