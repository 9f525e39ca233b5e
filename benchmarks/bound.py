"""An upper bound on requests on time: what no schedule of a trace on a device can beat.

The yardsticks of `benchmarks.heuristics` say how dynbatchd does against other rules; this says
how far any rule could go. It relaxes the problem twice: a request may be served in part (counts
its part) and its device time may be split across moments (preemption), and each request costs
its own time plus a full batch's share of the fixed cost (`base / max_batch`, the least it can
cost in any batch). Every real schedule is such a fluid one, so the fluid optimum bounds them all.

With one relative deadline for every request (the replays of `benchmarks.bursty`) request
windows never nest out of order, and a set of parts fits the device if and only if, for every
run of consecutive arrivals i..j, their work fits between the first's arrival and the last's
deadline. That region is a polymatroid, so the greedy fill, in order of worth per unit of device
time, each request as much as still fits, is optimal (Edmonds). A floor on the longest requests
on time is priced in by Lagrange: the bound is the least, over a price p of a long request, of
the best worth (a long request worth 1 + p) less p times the floor.
"""

from __future__ import annotations

import argparse
from typing import Sequence

import numpy as np

from dynbatchd.simulate import Arrival, DeviceModel, read_trace_csv

from benchmarks.traces import add_replay_options, sped_up, start_replay

MS = 1_000_000


def fluid_parts(arrivals: Sequence[Arrival], device: DeviceModel, deadline_ms: float, max_batch: int = 32,
                worth: Sequence[float] | None = None) -> np.ndarray:
    """The part of each request served (0 to 1) in the fluid schedule of the most total worth
    (default: 1 a request). Requests that cannot finish even alone get none."""
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i].at_ns)
    at = np.array([arrivals[i].at_ns for i in order], dtype=float)
    tokens = np.array([arrivals[i].tokens for i in order], dtype=float)
    own = (device.per_item_ms + device.per_token_ms * tokens) * MS
    work = own + device.base_ms * MS / max_batch
    alone = device.base_ms * MS + own <= deadline_ms * MS
    value = np.ones(len(order)) if worth is None else np.array([worth[i] for i in order], dtype=float)
    # For runs a..b of arrivals: work(a..b) <= deadline_b - at_a. With P the prefix sums of the
    # work served, room_end[b] = deadline_b - P[b] and room_start[a] = at_a - P[a-1]; a request
    # i can take min(room_end[i:]) - max(room_start[:i+1]) more.
    room_end = at + deadline_ms * MS
    room_start = at.copy()
    served = np.zeros(len(order))
    for i in np.argsort(-value / work, kind="stable"):
        if not alone[i] or value[i] <= 0:
            continue
        more = min(work[i], room_end[i:].min() - room_start[:i + 1].max())
        if more > 0:
            served[i] = more
            room_end[i:] -= more
            room_start[i + 1:] -= more
    parts = np.zeros(len(order))
    parts[order] = served / work
    return parts


def most_on_time(arrivals: Sequence[Arrival], device: DeviceModel, deadline_ms: float, max_batch: int = 32,
                 longest: Sequence[int] = (), floor: float = 0.0) -> float:
    """No schedule gets more requests on time than this while it serves at least `floor` of the
    requests `longest` (indices) on time. The price of a long request is found by bisection to
    where the fluid optimum serves `floor` of them (any price gives a bound; that one the least)."""
    is_long = np.zeros(len(arrivals))
    is_long[list(longest)] = 1.0

    def bound(price: float) -> tuple[float, float]:
        parts = fluid_parts(arrivals, device, deadline_ms, max_batch, 1.0 + price * is_long)
        long = float(parts @ is_long)
        return float(parts.sum()) + price * (long - floor), long

    best, long = bound(0.0)
    if long >= floor:
        return best
    low, high = 0.0, 1.0
    while bound(high)[1] < floor and high < 1024:
        low, high = high, 2 * high
    for _ in range(20):
        mid = (low + high) / 2
        value, long = bound(mid)
        best = min(best, value)
        low, high = (mid, high) if long < floor else (low, mid)
    return min(best, bound(high)[0])


def main(argv: list[str] | None = None) -> int:
    """Print the bound per speed-up, and how much of it is partial credit: the requests the fluid
    optimum serves whole are themselves a feasible (preemptive) schedule, so the few it serves in
    part are all the slack that relaxation adds."""
    from benchmarks.bursty import DEADLINE_MS, DEVICE   # here: bursty imports this module

    ap = argparse.ArgumentParser(prog="python -m benchmarks.bound", description=__doc__.split("\n\n")[0])
    add_replay_options(ap)
    args = start_replay(ap, argv)
    if args is None:
        return 2
    print(f"trace {args.trace.name}; SIMULATED device as benchmarks.bursty; deadline {DEADLINE_MS:g} ms\n")
    print("| speed-up | upper bound (requests) | served whole | served in part |")
    print("|---|---|---|---|")
    rows = read_trace_csv(args.trace)
    for speedup in (float(s) for s in args.speedups.split(",")):
        arrivals = sped_up(rows, speedup)
        parts = fluid_parts(arrivals, DEVICE, DEADLINE_MS)
        whole = int((parts > 1 - 1e-9).sum())
        print(f"| x{speedup:g} | {parts.sum():.1f} | {whole} | {int((parts > 1e-9).sum()) - whole} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
