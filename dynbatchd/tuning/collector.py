"""Collector: one channel's observations from the daemon's `status`, and a refusal when they are
too few to tune from (a plan fitted to a handful of batches is a guess, and says so).

The window: `tune --auto` reads `status` twice, `--window` seconds apart, and takes the offered
rate and on-time share of that window (`over_window`); the batch cost (`cost_ms`) is what the
daemon learned from the batches it timed. A single `status` (no window) falls back to the
daemon's rate meter, which counts admitted arrivals only."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dynbatchd.errors import DynbatchdError
from dynbatchd.telemetry import on_time_fraction

MIN_BATCHES = 20      # as CostModel.settled: a younger cost fit can be far off
MIN_REQUESTS = 200    # answered requests before the on-time share means anything


class NotEnoughData(DynbatchdError, ValueError):
    """Too little observed to recommend from; the message says how much is needed and how much there is."""


@dataclass(frozen=True, slots=True)
class Observation:
    channel: str
    arrival_rps: float
    mean_tokens: float
    cost_base_ms: float
    cost_per_item_ms: float
    cost_per_token_ms: float
    cost_samples: int
    answered: int
    on_time: float          # the channel's on-time share so far (status' definition)
    p99_ms: float
    devices: int
    max_batch: int
    window_ms: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def over_window(before: dict[str, Any], after: dict[str, Any], seconds: float) -> dict[str, Any]:
    """`after` with each channel's arrival rate and on-time share measured between two `status`
    replies `seconds` apart: the requests offered in the window (refused and overloaded ones
    included, which the daemon's own rate meter, counting admitted arrivals, leaves out)."""
    out = {**after, "channels": {}}
    for name, c in after.get("channels", {}).items():
        b = before.get("channels", {}).get(name, {})
        offered = c.get("offered", 0) - b.get("offered", 0)
        on_time = c.get("on_time_count", 0) - b.get("on_time_count", 0)
        out["channels"][name] = {**c, "arrival_rps": offered / seconds if seconds > 0 else 0.0,
                                 "on_time": on_time_fraction(on_time, offered) if offered > 0 else c.get("on_time", 0.0),
                                 "window_s": seconds}
    return out


def collect(status: dict[str, Any], channel: str, *, min_batches: int = MIN_BATCHES,
            min_requests: int = MIN_REQUESTS) -> Observation:
    """The observations of `channel` in a `status` reply (or an `over_window` of two);
    NotEnoughData when they are too few."""
    channels = status.get("channels", {})
    if channel not in channels:
        raise NotEnoughData(f"no channel named {channel!r} in the daemon's status")
    c = channels[channel]
    cost = c.get("cost_ms", {})
    samples = int(cost.get("samples", 0))
    answered = int(c.get("offered", c.get("completed", 0)))
    short = []
    if samples < min_batches:
        short.append(f"{min_batches} timed batches to know their cost (has {samples})")
    if answered < min_requests:
        short.append(f"{min_requests} answered requests (has {answered})")
    if c.get("arrival_rps", 0.0) <= 0:
        short.append("traffic in the last seconds (arrival rate is 0)")
    if short:
        raise NotEnoughData(f"channel {channel!r}: too little data to tune from: needs " + "; ".join(short))
    window = c.get("window", {}).get("window_ms")
    return Observation(channel, float(c["arrival_rps"]), float(c.get("mean_tokens", 0.0)),
                       float(cost["base"]), float(cost["per_item"]), float(cost["per_token"]), samples,
                       answered, float(c.get("on_time", 0.0)), float(c.get("p99_ms", 0.0)),
                       max(1, len(status.get("devices", []))), int(c.get("max_batch", 0)),
                       float(window) if isinstance(window, (int, float)) else None)
