"""Long requests in bursts at low load (SIMULATED): does the planner keep them at FIFO's share?

    python -m benchmarks.longburst                # about 1 min

A stand-in for a code-completion trace (issue 26; the real one, the Azure
release's AzureLLMInferenceTrace_code.csv, replays with
``python -m benchmarks.bursty --trace PATH``): `benchmarks.traces.long_bursts`, short requests at ~18% load with a
burst of long ones every 15 s (mean load ~47%), on the device and channels of
`benchmarks.bursty`. Printed: on-time share of all requests and of the longest
10%, and the latter as a part of FIFO-drop's (the bar: at least 0.9), for
dynbatchd's setups beside the yardsticks of `benchmarks.heuristics`. Seeds
1-3 by default, so one draw's luck does not decide.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

from dynbatchd.plugins import Plugins
from dynbatchd.simulate import simulate

from benchmarks.bursty import DEADLINE_MS, DEVICE, longest_tenth, setups
from benchmarks.heuristics import edf_plan_drop_largest, fifo_drop_hopeless
from benchmarks.traces import long_bursts


def mean_load(arrivals) -> float:
    """Device time the arrivals need in full batches of 32, over the trace's span."""
    per = DEVICE.base_ms / 32 + DEVICE.per_item_ms
    work_ms = sum(per + DEVICE.per_token_ms * a.tokens for a in arrivals)
    return work_ms / ((arrivals[-1].at_ns - arrivals[0].at_ns) / 1e6)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.longburst", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1,2,3")
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print("python -m benchmarks.longburst " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    print(f"commit {commit}; SIMULATED device {DEVICE.base_ms} ms + {DEVICE.per_item_ms} ms/item + "
          f"{DEVICE.per_token_ms} ms/token; max batch 32; deadline {DEADLINE_MS:g} ms\n")
    plugins = Plugins.load()
    print("| seed | mean load | setup | on time | longest 10% on time | of FIFO-drop's |")
    print("|---|---|---|---|---|---|")
    for seed in (int(s) for s in args.seeds.split(",")):
        trace = long_bursts(seed=seed)
        arrivals = trace.arrivals
        longest = longest_tenth(arrivals)
        fifo = fifo_drop_hopeless(arrivals, DEVICE, DEADLINE_MS)
        fifo_long = fifo.share(longest)
        load = f"{mean_load(arrivals):.0%}"
        for name, channel in setups().items():
            r = simulate({"c": channel}, arrivals, device=DEVICE, window_policies=plugins.window_policies())
            share = sum(r.on_time(i) for i in longest) / len(longest)
            print(f"| {seed} | {load} | dynbatchd, {name} | {r.total().on_time_fraction:.2%} | {share:.1%} | "
                  f"{share / fifo_long:.2f} |", flush=True)
        plan = edf_plan_drop_largest(arrivals, DEVICE, DEADLINE_MS)
        for name, y in (("FIFO, drop the hopeless", fifo), ("deadline-order plan, drop the largest", plan)):
            print(f"| {seed} | {load} | {name} | {y.share():.2%} | {y.share(longest):.1%} | "
                  f"{y.share(longest) / fifo_long:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
