"""Issue 30 on the fake-clock simulator: the `slo` window near a device's limit, with and without
its opt-in near-saturation rule (``headroom``). SIMULATED: the daemon's engine on a virtual clock.

Devices shaped like MiniLM on one CPU thread (a fixed cost a batch + a cost an item, each batch's
time scaled by a seeded Gaussian jitter), Poisson arrivals, max batch 32, deadline = SLO = 250 ms.
Prints, per device and rate (a share of what full batches serve): the on-time share (a request
answered ok within its deadline), p99 and mean batch, default against ``headroom = 0.85``.

    python -m benchmarks.knee [--seconds 30] [--jitter 0.15]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--jitter", type=float, default=0.15)
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
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
