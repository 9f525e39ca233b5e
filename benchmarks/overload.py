"""Past the peak: requests answered on time a second at 1x, 2x and 4x what the device can serve,
here and at another commit, sides alternating.

    python -m benchmarks.overload 5a432a6                    # sim-b32, 1x 2x 4x of 1,333 req/s, 2 rounds
    python -m benchmarks.overload 5a432a6 --scenario sim-b32 --multiples 1,2,4 --rounds 3

A daemon that refuses cheaply keeps serving its peak however much more is offered; one whose
refusals cost more as its queue grows answers fewer as the offered rate rises (issue 24: on the
H200 the answered rate fell by 30-65% at 2-4x). For each multiple of the scenario's device limit:
the ok replies within the channel's deadline a second (`on time/s`), their share of the same side's
1x figure, errors, and the daemon's CPU per request. The device is SIMULATED (a sleep), so the
figures show the daemon's own cost, not a model's. Each side runs its own tree's daemon, harness
and load generator (only their stable calls, so older commits run).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.compare import REPO, export

# Run inside one tree (PYTHONPATH = that tree): one daemon, one run at each rate, one JSON line each.
PROBE = """
import json, sys
from benchmarks import loadgen
from benchmarks.harness import RunningDaemon, cpu_delta
from benchmarks.scenarios import all_scenarios
name, duration, rates = sys.argv[1], float(sys.argv[2]), [float(x) for x in sys.argv[3].split(",")]
sc = {s.name: s for s in all_scenarios()}[name]
deadline_s = sc.channel.get("deadline_ms", 1000.0) / 1000
with RunningDaemon(sc.name, sc.models, sc.channel, cpu_threads=sc.cpu_threads) as d:
    loadgen.run(d.endpoint, sc.model, rates[0] / 2, 1.0, inputs=sc.inputs, seed=999)
    for i, rate in enumerate(rates):
        before = d.cpu()
        r = loadgen.run(d.endpoint, sc.model, rate, duration, inputs=sc.inputs, seed=i + 1, raw=True,
                        drain_s=deadline_s + 3.0)
        cpu = cpu_delta(before, d.cpu(), r.sent)
        raw = r.raw
        on_time = sum(1 for o, t, ok in zip(raw["offsets"], raw["done"], raw["ok"]) if ok and t - o <= deadline_s)
        print("probe: " + json.dumps({"rate": rate, "on_time_rps": on_time / duration, "achieved": r.achieved_rps,
                                      "errors": r.error_count, "sent": r.sent, "daemon_us": cpu["daemon_us_per_req"]}),
              flush=True)
d.cleanup()
"""


def probe(tree: Path, scenario: str, rates: list[float], duration: float) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE, scenario, str(duration), ",".join(map(str, rates))],
                         cwd=tree, env=env, capture_output=True, text=True)
    lines = [json.loads(ln[len("probe: "):]) for ln in out.stdout.splitlines() if ln.startswith("probe: ")]
    if out.returncode != 0 or len(lines) != len(rates):
        raise SystemExit(f"probe failed in {tree}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.overload", description=__doc__.split("\n\n")[0])
    ap.add_argument("ref", help="the commit to compare this tree with")
    ap.add_argument("--scenario", default="sim-b32", help="a scenario of benchmarks/scenarios.py with a limit")
    ap.add_argument("--multiples", default="1,2,4", help="offered rates as multiples of the device limit")
    ap.add_argument("--duration", type=float, default=4.0, help="seconds at each rate (default 4)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs per side (default 2)")
    args = ap.parse_args(argv)
    from benchmarks.scenarios import all_scenarios
    sc = {s.name: s for s in all_scenarios()}[args.scenario]
    if not sc.limit:
        raise SystemExit(f"scenario {args.scenario} has no device limit to multiply")
    multiples = [float(m) for m in args.multiples.split(",")]
    rates = [m * sc.limit for m in multiples]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    print("python -m benchmarks.overload " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])))
    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; {sc.title}; device limit {sc.limit:,.0f} req/s "
          f"(SIMULATED); ref {args.ref} vs this tree at {head}")
    runs: dict[str, list[list[dict]]] = {"ref": [], "this": []}
    with tempfile.TemporaryDirectory(prefix="dynbatchd-ref-") as tmp:
        ref_tree = export(args.ref, Path(tmp))
        for round_ in range(args.rounds):
            for side, tree in (("ref", ref_tree), ("this", REPO)):
                lines = probe(tree, args.scenario, rates, args.duration)
                runs[side].append(lines)
                print(f"  round {round_ + 1} {side:>4}: " + ", ".join(
                    f"{m:g}x {ln['on_time_rps']:,.0f} on time/s ({ln['daemon_us']} µs/req)"
                    for m, ln in zip(multiples, lines)), flush=True)
    print(f"\n| offered | on time/s {args.ref} | share of its 1x | on time/s {head} | share of its 1x | "
          f"errors {args.ref} | errors {head} | daemon µs/req {args.ref} | {head} |")
    print("|---|---|---|---|---|---|---|---|---|")

    def mean(side: str, i: int, key: str) -> float:
        return sum(r[i][key] for r in runs[side]) / len(runs[side])
    base = {side: mean(side, 0, "on_time_rps") for side in runs}
    for i, m in enumerate(multiples):
        ref, this = mean("ref", i, "on_time_rps"), mean("this", i, "on_time_rps")
        print(f"| {m:g}x ({rates[i]:,.0f}/s) | {ref:,.0f} | {ref / base['ref']:.2f} | {this:,.0f} | "
              f"{this / base['this']:.2f} | {mean('ref', i, 'errors'):,.0f} | {mean('this', i, 'errors'):,.0f} | "
              f"{mean('ref', i, 'daemon_us'):.1f} | {mean('this', i, 'daemon_us'):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
