"""Offered more than it can take: how many no-op requests a second the daemon answers, here and at
another commit, sides alternating.

    python -m benchmarks.saturation dfc55c0                  # 32,000 req/s offered, 3 rounds
    python -m benchmarks.saturation dfc55c0 --rate 40000 --rounds 5

Goodput (`benchmarks.compare`) is the highest rate whose p99 stays under 50 ms: near the knee one
slow run moves it a whole search step (x1.3). This measures the knee itself: noop-b64's daemon,
a second at 2,000 req/s, then `--duration` s at `--rate`; printed are the ok replies a second over
the run (`achieved`), the mean batch and the daemon's CPU per request. Each side runs with its own
tree's daemon, harness and load generator (only their stable calls are used, so older commits run).
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

# Run inside one tree (PYTHONPATH = that tree): one daemon, one overload run, one JSON line.
PROBE = """
import json, sys
from benchmarks import loadgen
from benchmarks.harness import RunningDaemon, cpu_delta
from benchmarks.scenarios import all_scenarios
rate, duration = float(sys.argv[1]), float(sys.argv[2])
sc = {s.name: s for s in all_scenarios()}["noop-b64"]
with RunningDaemon(sc.name, sc.models, sc.channel, cpu_threads=sc.cpu_threads) as d:
    loadgen.run(d.endpoint, sc.model, 2000, 1.0, inputs=sc.inputs, seed=999)
    before = d.cpu()
    r = loadgen.run(d.endpoint, sc.model, rate, duration, inputs=sc.inputs, seed=1)
    cpu = cpu_delta(before, d.cpu(), r.sent)
d.cleanup()
print("probe: " + json.dumps({"achieved": r.achieved_rps, "batch": r.mean_batch, "errors": r.error_count,
                              "daemon_us": cpu["daemon_us_per_req"]}))
"""


def probe(tree: Path, rate: float, duration: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE, str(rate), str(duration)], cwd=tree, env=env,
                         capture_output=True, text=True)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("probe: ")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(f"probe failed in {tree}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return json.loads(line[len("probe: "):])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.saturation", description=__doc__.split("\n\n")[0])
    ap.add_argument("ref", help="the commit to compare this tree with")
    ap.add_argument("--rate", type=float, default=32000.0, help="offered requests/s (default 32,000)")
    ap.add_argument("--duration", type=float, default=3.0, help="seconds at that rate (default 3)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs per side (default 3)")
    args = ap.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    print("python -m benchmarks.saturation " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])))
    print(f"{os.cpu_count()} cores; noop-b64 offered {args.rate:,.0f} req/s; ref {args.ref} vs this tree at {head}")
    runs: dict[str, list[dict]] = {"ref": [], "this": []}
    with tempfile.TemporaryDirectory(prefix="dynbatchd-ref-") as tmp:
        ref_tree = export(args.ref, Path(tmp))
        for round_ in range(args.rounds):
            for side, tree in (("ref", ref_tree), ("this", REPO)):
                r = probe(tree, args.rate, args.duration)
                runs[side].append(r)
                print(f"  round {round_ + 1} {side:>4}: answered {r['achieved']:,.0f} ok/s, mean batch {r['batch']}, "
                      f"daemon {r['daemon_us']} µs/request, errors {r['errors']}", flush=True)

    def mean(side: str, key: str) -> float:
        return sum(r[key] for r in runs[side]) / len(runs[side])

    a0, a1 = mean("ref", "achieved"), mean("this", "achieved")
    c0, c1 = mean("ref", "daemon_us"), mean("this", "daemon_us")
    print(f"\n| answered ok/s {args.ref} | {head} | ratio | daemon µs/req {args.ref} | {head} | ratio |\n|---|---|---|---|---|---|")
    print(f"| {a0:,.0f} | {a1:,.0f} | {a1 / a0:.2f} | {c0:.1f} | {c1:.1f} | {c1 / c0:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
