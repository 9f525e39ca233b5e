"""The daemon's CPU time to cut each batch (`Channel.form`: the plan), on a trace replay.

    python -m benchmarks.plan_time                                   # the conversation trace
    python -m benchmarks.plan_time --trace AzureLLMInferenceTrace_code.csv --speedups 60,80
    python -m benchmarks.plan_time --trace code.csv --against d8f1b39 --rounds 3

Why it matters: a device's queued slot opens `queue_lead_ms` (1 ms) before it frees, and the
daemon then cuts the next batch. A plan that takes longer than that leaves the device idle for
the difference, on every batch that does. The simulator does not see it (its clock stands still
while the engine thinks), so it showed live as on-time share lost under a backlog of long
requests: the code trace at x80 read 84.6% live against 86.2% simulated while its plans took 6.8
ms at the 90th percentile (docs/benchmarks.md).

The replay is `benchmarks.bursty`'s (SIMULATED device, fixed 10 ms window); what is timed is the
real wall time of each `form` call on this machine. Printed per speed-up: batches, the median,
90th and 99th percentile of a batch's planning time, the batches slower than the 1 ms lead, and
the total. With ``--against REF`` the same replay runs at that commit too (exported as
`benchmarks.compare` does), sides alternating, and the ratios this/ref are printed: the machines
are shared and noisy, so compare ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LEAD_MS = 1.0   # the default `[devices] queue_lead_ms`


def measure(trace: Path, speedups: list[float]) -> dict[str, dict[str, float]]:
    """Per speed-up: the planning time of each batch of the replay, summarised (ms, s)."""
    from dynbatchd.plugins import Plugins
    from dynbatchd.scheduler.channel import Channel
    from dynbatchd.simulate import read_trace_csv, simulate

    from benchmarks.bursty import DEVICE, setups
    from benchmarks.traces import sped_up

    spent: list[float] = []
    form = Channel.form

    def timed_form(self, *args, **kwargs):
        began = time.perf_counter_ns()
        try:
            return form(self, *args, **kwargs)
        finally:
            spent.append((time.perf_counter_ns() - began) / 1e6)

    Channel.form = timed_form
    try:
        rows = read_trace_csv(trace)
        policies = Plugins.load().window_policies()
        out = {}
        for speedup in speedups:
            spent.clear()
            simulate({"c": setups()["fixed 10 ms"]}, sped_up(rows, speedup), device=DEVICE, window_policies=policies)
            ranked = sorted(spent)
            out[f"{speedup:g}"] = {"batches": len(ranked), "p50": ranked[len(ranked) // 2],
                                   "p90": ranked[int(0.9 * (len(ranked) - 1))],
                                   "p99": ranked[int(0.99 * (len(ranked) - 1))],
                                   "over_lead": sum(1 for t in ranked if t > LEAD_MS), "total_s": sum(ranked) / 1e3}
        return out
    finally:
        Channel.form = form


def measure_in(tree: Path, trace: Path, speedups: str) -> dict[str, dict[str, float]]:
    """`measure` run by this file against the dynbatchd of `tree` (its benchmarks too)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, __file__, "--trace", str(trace), "--speedups", speedups, "--json"],
                         cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the replay failed in {tree}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.traces import add_replay_options, start_replay

    ap = argparse.ArgumentParser(prog="python -m benchmarks.plan_time", description=__doc__.split("\n\n")[0])
    add_replay_options(ap)
    ap.add_argument("--against", metavar="REF", help="also at this commit, side by side")
    ap.add_argument("--rounds", type=int, default=1, help="with --against: alternating rounds a side")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)   # (one side, for --against)
    if "--json" in (argv if argv is not None else sys.argv[1:]):
        args = ap.parse_args(argv)
        print(json.dumps(measure(args.trace.resolve(), [float(s) for s in args.speedups.split(",")])))
        return 0
    args = start_replay(ap, argv)
    if args is None:
        return 2
    trace = args.trace.resolve()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}; trace {trace.name}; planning time per batch (wall ms on this machine); "
          f"replay SIMULATED as benchmarks.bursty\n")
    sides = {"this": Path(__file__).resolve().parent.parent}
    with tempfile.TemporaryDirectory(prefix="dynbatchd-plan-time-") as tmp:
        if args.against:
            from benchmarks.compare import export
            sides = {args.against: export(args.against, Path(tmp) / "ref"), **sides}
        runs: dict[str, list[dict]] = {name: [] for name in sides}
        for _ in range(args.rounds if args.against else 1):
            for name, tree in sides.items():
                runs[name].append(measure_in(tree, trace, args.speedups))
    print("| speed-up | side | batches | p50 ms | p90 ms | p99 ms | over the 1 ms lead | total s |")
    print("|---|---|---|---|---|---|---|---|")
    for speedup in runs["this"][0]:
        best = {name: min((r[speedup] for r in results), key=lambda r: r["total_s"])   # (the least disturbed round)
                for name, results in runs.items()}
        for name, b in best.items():
            print(f"| x{speedup} | {name} | {b['batches']} | {b['p50']:.2f} | {b['p90']:.2f} | "
                  f"{b['p99']:.2f} | {b['over_lead']} | {b['total_s']:.2f} |")
        if args.against:
            ref, new = best[args.against], best["this"]
            print(f"| x{speedup} | this/ref | | | {new['p90'] / ref['p90']:.2f} | {new['p99'] / ref['p99']:.2f} | | "
                  f"{new['total_s'] / ref['total_s']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
