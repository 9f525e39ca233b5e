"""Arrival traces for the adaptive-batching benchmarks (deterministic: every generator takes a seed).

- `phased`: steady low -> burst ×4 -> steady medium, short:medium:long tokens = 7:2:1 (the guide's mix).
- `k12_surge`: the guide's K12 evening: load ×4 for a (compressed) hour, 95% short (< 512 tokens),
  5% long (10k+ tokens, essay grading), a share of the short ones tagged ``urgent``.
- `azure_conv`: the real Azure LLM conversation trace (2023-11-16, one hour, 19,366 requests),
  time-compressed; ContextTokens become each request's token count.

A trace is a list of `dynbatchd.simulate.Arrival` plus named phases (spans of arrival time).
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dynbatchd.simulate import Arrival, mix_tokens, poisson_times, read_trace_csv

SECOND = 1_000_000_000
REPO = Path(__file__).resolve().parent.parent
AZURE_CSV = REPO.parent / "shared/data/azure-llm-2023-conv.csv"


@dataclass
class Trace:
    name: str
    arrivals: list[Arrival]
    phases: list[tuple[str, int, int]] = field(default_factory=list)   # (name, start_ns, end_ns)
    description: str = ""

    @property
    def duration_s(self) -> float:
        if self.phases:
            return (self.phases[-1][2] - self.phases[0][1]) / SECOND
        return (self.arrivals[-1].at_ns - self.arrivals[0].at_ns) / SECOND if self.arrivals else 0.0

    def phase(self, name: str) -> tuple[int, int]:
        for p, lo, hi in self.phases:
            if p == name:
                return lo, hi
        raise KeyError(name)



def phased(*, low_rps: float = 300.0, burst_factor: float = 4.0, medium_rps: float = 600.0,
           seconds: tuple[float, float, float] = (4.0, 2.0, 4.0), seed: int = 1) -> Trace:
    """Steady low -> burst (low × burst_factor) -> steady medium; tokens mixed 7:2:1."""
    rng = random.Random(seed)
    rates = (("steady-low", low_rps), ("burst", low_rps * burst_factor), ("steady-medium", medium_rps))
    arrivals, phases, t = [], [], 0
    for (name, rate), secs in zip(rates, seconds):
        end = t + int(secs * SECOND)
        for at in poisson_times(rng, rate, t, end):
            size, tokens = mix_tokens(rng)
            arrivals.append(Arrival(at, tokens))
        phases.append((name, t, end))
        t = end
    return Trace("phased", arrivals, phases,
                 f"{low_rps:g} rps {seconds[0]:g} s -> {low_rps * burst_factor:g} rps {seconds[1]:g} s -> "
                 f"{medium_rps:g} rps {seconds[2]:g} s, Poisson; tokens short:medium:long = 7:2:1")


def k12_surge(*, base_rps: float = 330.0, surge_factor: float = 4.0, before_s: float = 4.0,
              surge_s: float = 20.0, after_s: float = 6.0, long_share: float = 0.05,
              urgent_share: float = 0.10, seed: int = 2) -> Trace:
    """The K12 evening: base load, then ×surge_factor for `surge_s` (the compressed hour), then base.

    95% short (32..511 tokens), 5% long (10,001..14,000 tokens: essays). A share of the short ones
    is tagged ``urgent``. Each arrival is labelled with the class the guide's routing would give it
    (realtime / standard / bulk) and carries that class's SLO, so a single FIFO queue can be scored
    against the same targets.
    """
    rng = random.Random(seed)
    spans = (("before", base_rps, before_s), ("surge", base_rps * surge_factor, surge_s),
             ("after", base_rps, after_s))
    slo = {"realtime": 200.0, "standard": 1000.0, "bulk": 30000.0}
    arrivals, phases, t = [], [], 0
    for name, rate, secs in spans:
        end = t + int(secs * SECOND)
        for at in poisson_times(rng, rate, t, end):
            if rng.random() < long_share:
                tokens, tags, label = rng.randint(10_001, 14_000), (), "bulk"
            elif rng.random() < urgent_share:
                tokens, tags, label = rng.randint(32, 511), ("urgent",), "realtime"
            else:
                tokens, tags, label = rng.randint(32, 511), (), "standard"
            arrivals.append(Arrival(at, tokens, tags=tags, label=label, slo_ms=slo[label]))
        phases.append((name, t, end))
        t = end
    return Trace("k12-surge", arrivals, phases,
                 f"{base_rps:g} rps, ×{surge_factor:g} for {surge_s:g} s (the compressed evening hour); "
                 f"{1 - long_share:.0%} short < 512 tokens, {long_share:.0%} long > 10k tokens; "
                 f"{urgent_share:.0%} of short tagged urgent")


def azure_available(path: Path = AZURE_CSV) -> bool:
    return path.is_file()


def azure_rows(path: Path = AZURE_CSV) -> list[tuple[float, int]]:
    """(seconds since the first request, ContextTokens) per row, in time order."""
    return read_trace_csv(path)


def add_replay_options(ap: argparse.ArgumentParser) -> None:
    """--trace and --speedups, as every trace replay (bursty, bound, clairvoyant) takes them."""
    ap.add_argument("--trace", type=Path, default=AZURE_CSV,
                    help="a real trace: Azure LLM CSV, BurstGPT CSV or Mooncake JSON lines "
                         "(default: the conversation trace in ../shared/data)")
    ap.add_argument("--speedups", default="40,60,80", help="trace speed-ups, comma-separated")


def start_replay(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace | None:
    """A trace replay's options, parsed, and the command that makes its figures, printed (None, and
    a line on stderr, when its trace is missing)."""
    args = ap.parse_args(argv)
    if not args.trace.is_file():
        print(f"the trace {args.trace} is missing", file=sys.stderr)
        return None
    print(f"{ap.prog} " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])))
    return args


def sped_up(rows: list[tuple[float, int]], speedup: float) -> list[Arrival]:
    """The trace's requests with their times divided by `speedup`."""
    return [Arrival(int(t / speedup * 1e9), tokens) for t, tokens in rows]


def busiest_window(rows: list[tuple[float, int]], seconds: float) -> float:
    """Start (seconds into the trace) of the `seconds`-long window with the most arrivals."""
    best, best_n, j = 0.0, 0, 0
    times = [t for t, _ in rows]
    for i, t in enumerate(times):
        while j < len(times) and times[j] < t + seconds:
            j += 1
        if j - i > best_n:
            best, best_n = t, j - i
    return best


def azure_conv(*, compress: float = 50.0, start_s: float | None = None, span_s: float | None = None,
               path: Path = AZURE_CSV) -> Trace:
    """The Azure conversation trace, time-compressed ×`compress`.

    `start_s`/`span_s` select a slice in original seconds (default: the whole hour; start_s=None with a
    span picks the busiest span). Arrival times are divided by `compress`; tokens = ContextTokens.
    Raises FileNotFoundError when the data file is absent (callers skip cleanly).
    """
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (see ../shared/data/README.md)")
    rows = azure_rows(path)
    if span_s is not None and start_s is None:
        start_s = busiest_window(rows, span_s)
    lo = start_s or 0.0
    hi = lo + span_s if span_s is not None else float("inf")
    sel = [(t, k) for t, k in rows if lo <= t < hi]
    arrivals = [Arrival(int((t - lo) / compress * SECOND), k) for t, k in sel]
    end = int(((min(hi, rows[-1][0] + 1e-6) - lo) / compress) * SECOND)
    # Phases: each original minute of the slice, for per-minute load.
    phases = []
    minute = 60.0 / compress * SECOND
    m = 0
    while m * minute < end:
        phases.append((f"minute {int(lo // 60) + m}", int(m * minute), int(min(end, (m + 1) * minute))))
        m += 1
    return Trace("azure-conv", arrivals, phases,
                 f"Azure LLM conversation trace 2023-11-16, rows {len(sel)} from {lo:.0f} s for "
                 f"{(min(hi, rows[-1][0]) - lo):.0f} s, compressed ×{compress:g}; tokens = ContextTokens")


def long_bursts(*, seconds: float = 120.0, short_rps: float = 60.0, period_s: float = 15.0,
                burst_s: float = 1.0, burst_rps: float = 400.0, burst_long: float = 0.5,
                seed: int = 3) -> Trace:
    """Bursts of long requests at low mean load: a stand-in for a code-completion trace (issue 26).

    Short requests (200..2,000 tokens) arrive Poisson at `short_rps` throughout (~18% of the
    simulated device of `benchmarks.bursty`); every `period_s` a burst of `burst_s` adds
    `burst_rps` more, `burst_long` of them long (6,000..12,000 tokens): ~4 s of device time in
    1 s. The mean load is ~47%, but each burst overloads the device, which is where a planner that
    drops the largest request first serves the long ones at half of FIFO's share.
    """
    rng = random.Random(seed)
    arrivals, phases = [], []
    end = int(seconds * SECOND)
    for at in poisson_times(rng, short_rps, 0, end):
        arrivals.append(Arrival(at, rng.randint(200, 2000)))
    t = 0
    while t < end:
        lo, hi = t + int((period_s - burst_s) * SECOND), t + int(period_s * SECOND)
        for at in poisson_times(rng, burst_rps, lo, min(hi, end)):
            long = rng.random() < burst_long
            arrivals.append(Arrival(at, rng.randint(6000, 12000) if long else rng.randint(200, 2000)))
        phases.append(("quiet", t, lo))
        phases.append(("burst", lo, min(hi, end)))
        t = hi
    arrivals.sort(key=lambda a: a.at_ns)
    return Trace("long-bursts", arrivals, phases,
                 f"{short_rps:g} rps short for {seconds:g} s; every {period_s:g} s a {burst_s:g} s burst of "
                 f"+{burst_rps:g} rps, {burst_long:.0%} long (6k-12k tokens)")
