"""Arrivals to replay: one record type, one reader of real traces, one token mix.

Every generator takes a seed, so a replay is deterministic.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterator

SECOND = 1_000_000_000

# The guide's test mix, short:medium:long = 7:2:1, as (class, weight, fewest tokens, most tokens).
# Long reaches past 8,192 tokens, where the shipped config routes to the bulk channel.
GUIDE_MIX = (("short", 7, 16, 512), ("medium", 2, 513, 2048), ("long", 1, 2049, 12_000))


@dataclass(slots=True)
class Arrival:
    """One request of a trace. `channel` set: it goes there; else routing decides."""
    at_ns: int
    tokens: int = 0
    channel: str | None = None
    tags: tuple[str, ...] = ()
    tenant: str | None = None
    model: str = "sim"
    deadline_ms: float | None = None   # None: the channel's deadline
    slo_ms: float | None = None        # what counts as on time; None: the deadline
    label: str | None = None           # class for reports; None: the channel
    request_type: str | None = None
    user_frequency: str | None = None
    priority: int | None = None
    text: str | None = None            # the input, for the result cache (None: never cached)


def mix_tokens(rng: random.Random) -> tuple[str, int]:
    """A request size drawn from the guide's 7:2:1 mix: (its class, its tokens)."""
    name, _, lo, hi = rng.choices(GUIDE_MIX, weights=[w for _, w, _, _ in GUIDE_MIX])[0]
    return name, rng.randint(lo, hi)


def poisson(rng: random.Random, rate_rps: float, start: float, end: float, unit: float = 1.0) -> Iterator[float]:
    """Poisson arrival times in [start, end), in `unit`s of a second (1: seconds, SECOND: ns).

    The one arrival loop of the package (the CLI, the tuning loop, the capacity
    model, the benchmarks and the tests draw from it). Lazy, so a caller may draw
    from the same `rng` between arrivals (a token count, a tag) and a seed gives
    the same trace as before; a rate of 0 gives no arrival.
    """
    t = float(start)
    while rate_rps > 0:
        t += rng.expovariate(rate_rps) * unit
        if t >= end:
            return
        yield t


def poisson_times(rng: random.Random, rate_rps: float, start_ns: int, end_ns: int) -> list[int]:
    """Poisson arrival times in [start, end), in integer nanoseconds."""
    return [int(t) for t in poisson(rng, rate_rps, start_ns, end_ns, SECOND)]


def read_trace_csv(path: Any) -> list[tuple[float, int]]:
    """(seconds since the first request, tokens) per request of a real trace, in time order. Three
    public formats, told apart by their first line: a CSV with TIMESTAMP and ContextTokens
    columns (the Azure LLM inference traces), a CSV with Timestamp (seconds) and Request tokens
    columns (BurstGPT), or JSON lines with timestamp (milliseconds) and input_length (Mooncake)."""
    with open(path, newline="") as f:
        first = f.readline()
        f.seek(0)
        if first.lstrip().startswith("{"):
            rows = [(record["timestamp"] / 1000.0, int(record["input_length"]))
                    for record in map(json.loads, filter(str.strip, f))]
        elif "TIMESTAMP" in first:
            rows = [(_azure_seconds(row["TIMESTAMP"]), int(row["ContextTokens"])) for row in csv.DictReader(f)]
        elif "Timestamp" in first and "Request tokens" in first:
            rows = [(float(row["Timestamp"]), int(row["Request tokens"])) for row in csv.DictReader(f)]
        else:
            raise ValueError(f"{path}: not a trace this reads (a CSV with TIMESTAMP and ContextTokens, or "
                             "Timestamp and Request tokens; or JSON lines with timestamp and input_length)")
    rows.sort()
    t0 = rows[0][0] if rows else 0.0
    return [(t - t0, tokens) for t, tokens in rows]


def _azure_seconds(stamp: str) -> float:
    # "2023-11-16 18:15:46.6805900": seven fractional digits, more than datetime takes
    whole, _, frac = stamp.partition(".")
    return datetime.fromisoformat(whole).timestamp() + (float("0." + frac) if frac else 0.0)


def as_arrival(entry: Any) -> Arrival:
    """An Arrival from an Arrival, or from ``(time_ns, tokens, channel-or-metadata)``."""
    if isinstance(entry, Arrival):
        return entry
    at, tokens, *rest = entry
    meta = rest[0] if rest else None
    if meta is None or isinstance(meta, str):
        return Arrival(int(at), int(tokens), meta)
    meta = dict(meta)
    if "tags" in meta:
        meta["tags"] = tuple(meta["tags"])
    return Arrival(int(at), int(tokens), **meta)
