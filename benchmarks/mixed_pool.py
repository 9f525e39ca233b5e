"""Goodput of a fast + slow device pool: the engine's choice (where the batch finishes soonest, by each
device's learned cost) against the same pool dispatched round-robin. Every figure is SIMULATED.

    .venv/bin/python -m benchmarks.mixed_pool [--duration 5] [--seed 1]

Round-robin is the engine with its device choice replaced (here only) by a strict rotation: the
next batch goes to the next device in turn, waiting for it if it is full.
"""

from __future__ import annotations

import argparse
import random
import subprocess
from contextlib import contextmanager
from typing import Iterator

from dynbatchd.engine import slots as engine_module
from dynbatchd.config import ChannelSettings
from dynbatchd.simulate import DeviceModel, poisson, simulate

MS = 1_000_000
FAST = DeviceModel(base_ms=2.0, per_item_ms=0.1)    # e.g. a large GPU
SLOW = DeviceModel(base_ms=10.0, per_item_ms=0.5)   # five times slower at every batch size
CHANNELS = {"standard": ChannelSettings(max_batch=8, window_ms=5, deadline_ms=100)}


@contextmanager
def round_robin() -> Iterator[None]:
    """The engine's pick_device replaced by a strict rotation over the devices."""
    original, turn = engine_module.pick_device, [0]

    def pick(devices, now_ns, inflight, lead_ns, run_ns=None):   # noqa: ANN001 (pick_device's signature)
        i = turn[0] % len(devices)
        d = devices[i]
        if not d.usable or d.held >= inflight or (d.held and d.free_at_ns - lead_ns > now_ns):
            return None
        turn[0] += 1
        return i
    engine_module.pick_device = pick
    try:
        yield
    finally:
        engine_module.pick_device = original


def arrivals(rate: float, duration_s: float, seed: int) -> list[tuple[int, int, str]]:
    return [(int(t * 1e9), 0, "standard") for t in poisson(random.Random(seed), rate, 0.0, duration_s)]


def goodput(rate: float, duration_s: float, seed: int) -> float:
    r = simulate(CHANNELS, arrivals(rate, duration_s, seed), device=[FAST, SLOW])
    return r.total().goodput_rps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    full = FAST.capacity_rps(8) + SLOW.capacity_rps(8)
    print(f"SIMULATED mixed pool: fast {FAST.base_ms:g} ms + {FAST.per_item_ms:g} ms/request, slow "
          f"{SLOW.base_ms:g} ms + {SLOW.per_item_ms:g} ms/request; max_batch 8, window 5 ms, deadline 100 ms; "
          f"full-batch capacity {FAST.capacity_rps(8):.0f} + {SLOW.capacity_rps(8):.0f} = {full:.0f} req/s")
    print(f"commit {commit}; command: .venv/bin/python -m benchmarks.mixed_pool --duration {args.duration:g} "
          f"--seed {args.seed}")
    print(f"{'offered req/s':>14} {'engine goodput':>15} {'round-robin':>12} {'ratio':>7}")
    for share in (0.3, 0.5, 0.7, 0.85, 0.95):
        rate = share * full
        best = goodput(rate, args.duration, args.seed)
        with round_robin():
            rr = goodput(rate, args.duration, args.seed)
        print(f"{rate:14.0f} {best:15.1f} {rr:12.1f} {best / rr if rr else float('inf'):7.2f}x")


if __name__ == "__main__":
    main()
