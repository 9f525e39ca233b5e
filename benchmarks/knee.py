"""Issue 30 on the fake-clock simulator: the `slo` window near a device's limit, with and without
its opt-in near-saturation rule (``headroom``). SIMULATED: the daemon's engine on a virtual clock.

Devices shaped like MiniLM on one CPU thread (a fixed cost a batch + a cost an item, each batch's
time scaled by a seeded Gaussian jitter), Poisson arrivals, max batch 32, deadline = SLO = 250 ms.
Prints, per device and rate (a share of what full batches serve): the on-time share (a request
answered ok within its deadline), p99 and mean batch, default against ``headroom = 0.85``.

``--tight``: the tight SLO instead (p99 <= 50 ms, deadline = SLO), on the device the live MiniLM
daemon learned on this machine (`TIGHT_DEVICE`: 7.65 ms a batch + 0.53 ms an item + 0.25 ms a
token, each request the benchmark's own text: 7-14 tokens), several seeds a rate, judged by the
live benchmark's rule (`benchmarks.goodput`: p99 of the ok answers <= SLO and errors < 0.1 %),
with a few settings beside the shipped one.

    python -m benchmarks.knee [--seconds 30] [--jitter 0.15]
    python -m benchmarks.knee --tight [--seconds 20] [--seeds 8]
"""

from __future__ import annotations

import argparse
import random
import subprocess
from dataclasses import dataclass

from dynbatchd.config import ChannelSettings
from dynbatchd.config.schema import PolicySettings
from dynbatchd.simulate.devices import DeviceModel
from dynbatchd.simulate.driver import simulate
from dynbatchd.simulate.traces import poisson_times

from benchmarks.scenarios import TEXTS
from dynbatchd.protocol import Request, estimate_tokens

SHAPES = [(2.0, 2.75), (8.6, 2.44), (20.0, 2.2)]   # (base ms, per item ms): the brief's, issue 30's 10-vs-24 costs, heavier
SHARES = [0.8, 0.85, 0.9, 0.95]


@dataclass(frozen=True)
class JitteryDevice(DeviceModel):
    """Each attempt takes the model's time × max(0.5, 1 + N(0, jitter)), from a seeded stream."""
    jitter: float = 0.15
    seed: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "_rng", random.Random(self.seed))

    def attempt_ns(self, size: int, tokens: int) -> int:
        t = super().attempt_ns(size, tokens)
        return round(t * max(0.5, 1 + self._rng.gauss(0, self.jitter))) if self.jitter else t


def trial(base: float, per: float, rate: float, headroom: float | None, seconds: float, jitter: float,
          slo_ms: float = 250.0, seed: int = 1):
    options = {} if headroom is None else {"headroom": headroom}
    channel = ChannelSettings(max_batch=32, window_ms=slo_ms, deadline_ms=slo_ms,
                              window=PolicySettings(policy="slo", options=options))
    times = poisson_times(random.Random(seed), rate, 0, int(seconds * 1e9))
    device = JitteryDevice(base_ms=base, per_item_ms=per, jitter=jitter, seed=seed)
    result = simulate({"c": channel}, [(t, 16, "c") for t in times], device=device)
    return result.total(), result.mean_batch()


# The live MiniLM daemon's learned cost on this machine (status cost_ms at 130 req/s, c425413):
TIGHT_DEVICE = dict(base_ms=7.65, per_item_ms=0.53, per_token_ms=0.25)
TIGHT_TOKENS = [estimate_tokens(Request(id=0, model="m", text=t)) for t in TEXTS]   # what the daemon counts
TIGHT_RATES = [110.0, 120.0, 130.0, 140.0, 150.0]
# Settings beside the shipped one: (label, max_batch, inflight, run_late)
TIGHT_SETTINGS = [("shipped (max batch 32, inflight 2)", 32, 2, False), ("max batch 6", 6, 2, False),
                  ("inflight 1", 32, 1, False), ("run_late = true (contrast: misses answered late)", 32, 2, True)]


def tight_trial(rate: float, seed: int, max_batch: int = 32, inflight: int = 2, run_late: bool = False,
                seconds: float = 20.0, jitter: float = 0.15, slo_ms: float = 50.0):
    """One seeded run of the tight SLO: (GroupStats, mean batch, passes by the live benchmark's rule)."""
    channel = ChannelSettings(max_batch=max_batch, window_ms=slo_ms, deadline_ms=slo_ms, run_late=run_late,
                              window=PolicySettings(policy="slo", options={}))
    times = poisson_times(random.Random(seed), rate, 0, int(seconds * 1e9))
    device = JitteryDevice(**TIGHT_DEVICE, jitter=jitter, seed=seed)
    arrivals = [(t, TIGHT_TOKENS[i % len(TIGHT_TOKENS)], "c") for i, t in enumerate(times)]
    result = simulate({"c": channel}, arrivals, device=device, inflight=inflight)
    t = result.total()
    errors = t.expired + t.overloaded + t.failed
    return t, result.mean_batch(), t.p99_completed_ms <= slo_ms and errors < 0.001 * t.offered


def tight_table(seconds: float, jitter: float, seeds: int) -> None:
    print("| setting | req/s | passes (of seeds) | on time | expired | late (ok, past the deadline) "
          "| p99 of ok, ms (median, max) | mean batch |")
    print("|---|---|---|---|---|---|---|---|")
    for label, max_batch, inflight, run_late in TIGHT_SETTINGS:
        for rate in TIGHT_RATES:
            runs = [tight_trial(rate, seed, max_batch, inflight, run_late, seconds, jitter) for seed in range(1, seeds + 1)]
            offered = sum(t.offered for t, _, _ in runs)
            p99s = sorted(t.p99_completed_ms for t, _, _ in runs)
            print(f"| {label} | {rate:g} | {sum(ok for _, _, ok in runs)}/{seeds} "
                  f"| {100 * sum(t.on_time for t, _, _ in runs) / offered:.2f}% "
                  f"| {100 * sum(t.expired for t, _, _ in runs) / offered:.2f}% "
                  f"| {100 * sum(t.late for t, _, _ in runs) / offered:.2f}% "
                  f"| {p99s[len(p99s) // 2]:.1f}, {p99s[-1]:.1f} | {sum(b for _, b, _ in runs) / seeds:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=None, help="seconds of arrivals a run (default 30; --tight 20)")
    ap.add_argument("--jitter", type=float, default=0.15)
    ap.add_argument("--tight", action="store_true", help="the tight SLO (50 ms) on the live MiniLM's learned cost")
    ap.add_argument("--seeds", type=int, default=8, help="--tight: seeded runs a rate")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if args.tight:
        d = TIGHT_DEVICE
        print(f"commit {commit}; SIMULATED; device {d['base_ms']:g} ms + {d['per_item_ms']:g} ms/item + "
              f"{d['per_token_ms']:g} ms/token, requests of {min(TIGHT_TOKENS)}-{max(TIGHT_TOKENS)} tokens; "
              f"Poisson {args.seconds or 20:g} s x {args.seeds} seeds, jitter {args.jitter:g}; deadline = SLO = 50 ms\n")
        tight_table(args.seconds or 20.0, args.jitter, args.seeds)
        return
    args.seconds = args.seconds or 30.0
    print(f"commit {commit}; SIMULATED; Poisson {args.seconds:g} s, jitter {args.jitter:g}, max batch 32, SLO 250 ms\n")
    print("| device (base + per item) | share of limit | req/s | default: on time, p99 ms, batch "
          "| headroom 0.85: on time, p99 ms, batch |")
    print("|---|---|---|---|---|")
    for base, per in SHAPES:
        limit = 32 / (base + per * 32) * 1000
        for share in SHARES:
            cells = []
            for headroom in (None, 0.85):
                t, batch = trial(base, per, share * limit, headroom, args.seconds, args.jitter)
                cells.append(f"{100 * t.on_time_fraction:.2f}%, {t.p99_ms:.0f}, {batch:.1f}")
            print(f"| {base:g} + {per:g} ms | {share:.2f} | {share * limit:.1f} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
