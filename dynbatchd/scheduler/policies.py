"""The two pluggable decisions of a channel: how long to wait, and how big a batch.

Policies are plain objects built per channel by factories that plugins
register (hooks ``dynbatchd_window_policies`` / ``dynbatchd_batch_sizers``).
They see times in integer nanoseconds from the scheduler's injected clock and
never touch sockets, processes or wall time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from dynbatchd.scheduler.cost import CostModel

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
    cost: CostModel        # learned compute time per batch
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
