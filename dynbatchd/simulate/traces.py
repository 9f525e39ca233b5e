"""Arrivals to replay: one record type, one reader of real traces, one token mix.

Every generator takes a seed, so a replay is deterministic.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
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


# A row past these is a broken file, not a trace: about 3,000 years of seconds (an epoch date fits,
# and `at / compress * SECOND` stays a finite integer), and more tokens than any model's context.
MOST_SECONDS = 1e11
MOST_TOKENS = 10_000_000
FORMATS = ("a CSV with TIMESTAMP and ContextTokens, or Timestamp and Request tokens; or JSON lines with "
           "timestamp and input_length")


def read_trace_csv(path: Any, most: int | None = None) -> list[tuple[float, int]]:
    """(seconds since the first request, tokens) per request of a real trace, in time order. Three
    public formats, told apart by their first line: a CSV with TIMESTAMP and ContextTokens
    columns (the Azure LLM inference traces), a CSV with Timestamp (seconds) and Request tokens
    columns (BurstGPT), or JSON lines with timestamp (milliseconds) and input_length (Mooncake).
    Each row is checked (`_checked`): a bad one is a ValueError naming the file, its line and what is wrong.
    `most`: more rows than that is a ValueError, found by reading one past it, never the whole file
    (a caller that replays every row would otherwise hold gigabytes and run for minutes)."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:   # -sig: a spreadsheet's BOM is not a header
            first = f.readline()
            f.seek(0)
            rows = list(itertools.islice(_rows(path, f, first), None if most is None else most + 1))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:   # missing, a directory, unreadable: the file and why, not errno's repr
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if most is not None and len(rows) > most:
        raise ValueError(f"{path}: more than {most:,} requests; at most {most:,} a run (replay a part of it)")
    rows.sort()
    t0 = rows[0][0] if rows else 0.0
    return [(t - t0, tokens) for t, tokens in rows]


def _rows(path: Any, f: Any, first: str) -> Iterator[tuple[float, int]]:
    if first.lstrip().startswith("{"):
        for line, text in enumerate(f, 1):
            if text.strip():
                yield _checked(path, line, _mooncake, text)
        return
    if "TIMESTAMP" in first:
        columns, parse = ("TIMESTAMP", "ContextTokens"), lambda r: (_azure_seconds(_cell(r, "TIMESTAMP")),
                                                                     _cell(r, "ContextTokens"))
    elif "Timestamp" in first and "Request tokens" in first:
        columns, parse = ("Timestamp", "Request tokens"), lambda r: (_number("Timestamp", _cell(r, "Timestamp")),
                                                                      _cell(r, "Request tokens"))
    else:
        raise ValueError(f"{path}: not a trace this reads ({FORMATS})")
    reader = csv.DictReader(f)
    missing = [c for c in columns if c not in (reader.fieldnames or ())]
    if missing:   # "TIMESTAMP" within another header's name, say
        raise ValueError(f"{path}, line 1: the header has no {' or '.join(missing)} column ({FORMATS})")
    try:
        for row in reader:
            yield _checked(path, reader.line_num, parse, row)
    except csv.Error as exc:
        raise ValueError(f"{path}, line {reader.line_num}: not CSV: {exc}") from None


def _checked(path: Any, line: int, parse: Any, raw: Any) -> tuple[float, int]:
    """(seconds, tokens) of one row, or a ValueError naming the file and line: a finite timestamp
    from 0 to MOST_SECONDS, a whole token count from 0 to MOST_TOKENS."""
    try:
        seconds, tokens = parse(raw)
        if not 0.0 <= seconds <= MOST_SECONDS:
            raise ValueError(f"the time must be 0 to {MOST_SECONDS:g} s, got {seconds!r} s")
        return seconds, _tokens(tokens)
    except KeyError as exc:
        raise ValueError(f"{path}, line {line}: no {exc.args[0]}") from None
    except ValueError as exc:
        raise ValueError(f"{path}, line {line}: {exc}") from None


def _cell(row: dict[str, Any], column: str) -> Any:
    """`row`'s `column`; KeyError when the row is too short to have it (csv gives None)."""
    if row.get(column) is None:
        raise KeyError(column)
    return row[column]


def _mooncake(text: str) -> tuple[float, Any]:
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(record, dict):
        raise ValueError(f"not a JSON object, got {type(record).__name__}")
    return _number("timestamp", record["timestamp"]) / 1000.0, record["input_length"]


def _number(name: str, value: Any) -> float:
    """`value` (a JSON number or CSV text) as a finite float; ValueError naming `name` otherwise."""
    try:
        number = float(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else math.nan
    except (ValueError, OverflowError):
        number = math.nan
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r:.40}")
    return number


def _tokens(value: Any) -> int:
    number = _number("the token count", value.strip() if isinstance(value, str) else value)
    if not number.is_integer() or not 0 <= number <= MOST_TOKENS:
        raise ValueError(f"the token count must be a whole number 0 to {MOST_TOKENS}, got {value!r:.40}")
    return int(number)


def _azure_seconds(stamp: Any) -> float:
    # "2023-11-16 18:15:46.6805900": seven fractional digits, more than datetime takes
    whole, _, frac = str(stamp).partition(".")
    try:
        return datetime.fromisoformat(whole).timestamp() + (float("0." + frac) if frac else 0.0)
    except (ValueError, OverflowError, OSError):
        raise ValueError(f"TIMESTAMP must be a date and time like 2023-11-16 18:15:46.68, got {stamp!r:.40}") from None


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
