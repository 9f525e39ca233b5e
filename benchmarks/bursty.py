"""Bursty, mixed-size traffic: the Azure conversation trace replayed on a simulated device (SIMULATED).

    python -m benchmarks.bursty                 # x40, x60, x80; about 10 s
    python -m benchmarks.bursty --speedups 60

One channel, max_batch 32, deadline 1,000 ms, the device 8 ms + 0.5 ms/item +
0.002 ms/token, every request at its own size. dynbatchd's engine (windows
fixed 10 ms, fixed 100 ms, slo) beside the two yardsticks of
`benchmarks.heuristics`. Printed per speed-up: on-time share of all requests
and of the longest 10%, utilisation, mean batch, overloaded and expired.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

from dynbatchd.config import ChannelSettings, PolicySettings
from dynbatchd.plugins import Plugins
from dynbatchd.simulate import Arrival, DeviceModel, read_trace_csv, simulate

from benchmarks.heuristics import feasible_shortest_first, fifo_drop_hopeless
from benchmarks.traces import AZURE_CSV, azure_available

DEVICE = DeviceModel(base_ms=8.0, per_item_ms=0.5, per_token_ms=0.002)
DEADLINE_MS = 1000.0


def setups() -> dict[str, ChannelSettings]:
    common = dict(max_batch=32, deadline_ms=DEADLINE_MS, queue_limit=100_000)
    return {"fixed 10 ms": ChannelSettings(window_ms=10, **common),
            "fixed 100 ms": ChannelSettings(window_ms=100, **common),
            "slo (cap 100 ms)": ChannelSettings(window_ms=100, window=PolicySettings(policy="slo"), **common)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bursty", description=__doc__.split("\n\n")[0])
    ap.add_argument("--speedups", default="40,60,80", help="trace speed-ups, comma-separated")
    args = ap.parse_args(argv)
    if not azure_available():
        print(f"the trace {AZURE_CSV} is missing", file=sys.stderr)
        return 2
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print("python -m benchmarks.bursty " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    print(f"commit {commit}; SIMULATED device {DEVICE.base_ms} ms + {DEVICE.per_item_ms} ms/item + "
          f"{DEVICE.per_token_ms} ms/token; max batch 32; deadline {DEADLINE_MS:g} ms\n")
    rows = read_trace_csv(AZURE_CSV)
    plugins = Plugins.load()
    print("| speed-up | setup | on time | longest 10% on time | utilisation | mean batch | overloaded | expired |")
    print("|---|---|---|---|---|---|---|---|")
    for speedup in (float(s) for s in args.speedups.split(",")):
        arrivals = [Arrival(int(t / speedup * 1e9), tokens) for t, tokens in rows]
        cut = sorted(a.tokens for a in arrivals)[int(0.9 * len(arrivals))]
        longest = [i for i, a in enumerate(arrivals) if a.tokens >= cut]
        for name, channel in setups().items():
            r = simulate({"c": channel}, arrivals, device=DEVICE, window_policies=plugins.window_policies())
            total, counts = r.total(), r.counts()
            long_share = sum(r.on_time(i) for i in longest) / len(longest)
            print(f"| x{speedup:g} | dynbatchd, {name} | {total.on_time_fraction:.1%} | {long_share:.1%} | "
                  f"{r.utilisation():.1%} | {r.mean_batch():.1f} | {counts['overloaded']} | "
                  f"{counts['deadline_exceeded']} |")
        for name, heuristic in (("FIFO, drop the hopeless", fifo_drop_hopeless),
                                ("deadline-feasible, shortest first", feasible_shortest_first)):
            y = heuristic(arrivals, DEVICE, DEADLINE_MS)
            print(f"| x{speedup:g} | {name} | {y.share():.1%} | {y.share(longest):.1%} | | | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
