"""Before and after, same command, same machine: the benchmarks at another commit beside this tree.

    python -m benchmarks.compare dfc55c0                       # sim-b32 and noop-b64, quick runs
    python -m benchmarks.compare dfc55c0 --only sim-b32 --rounds 2

The other commit is exported (`git archive`) to a temporary directory and run
from there with PYTHONPATH pointing at it, so its daemon, plugins and
benchmark code are all its own; this tree runs as it is. Sides alternate
(ref, this, ref, this, ...) so a drift in the machine's load hits both.
Printed: goodput per scenario on each side and the ratio this/ref (the
machines are shared and noisy: compare ratios, not absolute figures).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def export(ref: str, into: Path) -> Path:
    """The tree of `ref` in `into`, importable as dynbatchd and dynbatchd_plugins."""
    archive = subprocess.run(["git", "archive", ref], cwd=REPO, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "dynbatchd_plugins").symlink_to(into / "plugins")
    return into


def run_side(tree: Path, only: str, quick: bool) -> dict[str, float]:
    """Goodput (req/s) per scenario from one `benchmarks.run_all` in `tree`."""
    command = [sys.executable, "-m", "benchmarks.run_all", "--only", only, "--quiet-wait", "5"] + (["--quick"] if quick else [])
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    found = re.search(r"^results: (.+)$", out.stdout, re.M)
    if out.returncode != 0 or not found:
        raise SystemExit(f"benchmarks failed in {tree}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    doc = json.loads(Path(found.group(1)).read_text())
    return {s["name"]: s.get("goodput_rps") or 0.0 for s in doc["scenarios"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("ref", help="the commit to compare this tree with")
    ap.add_argument("--only", default="sim-b32,noop-b64", help="scenarios (default: sim-b32,noop-b64)")
    ap.add_argument("--rounds", type=int, default=1, help="alternating runs per side (default 1)")
    ap.add_argument("--full", action="store_true", help="full-length runs instead of --quick")
    args = ap.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "dynbatchd", "plugins"],
                                cwd=REPO, capture_output=True, text=True).stdout.strip())
    print("python -m benchmarks.compare " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])))
    print(f"{os.cpu_count()} cores; ref {args.ref} vs this tree at {head}{' (dirty)' if dirty else ''}")
    runs: dict[str, dict[str, list[float]]] = {"ref": {}, "this": {}}
    with tempfile.TemporaryDirectory(prefix="dynbatchd-ref-") as tmp:
        ref_tree = export(args.ref, Path(tmp))
        for round_ in range(args.rounds):
            for side, tree in (("ref", ref_tree), ("this", REPO)):
                for name, goodput in run_side(tree, args.only, not args.full).items():
                    runs[side].setdefault(name, []).append(goodput)
                    print(f"  round {round_ + 1} {side:>4} {name}: goodput {goodput:,.0f} req/s", flush=True)
    print(f"\n| scenario | {args.ref} (req/s) | {head} (req/s) | ratio |\n|---|---|---|---|")
    for name in runs["ref"]:
        ref = sum(runs["ref"][name]) / len(runs["ref"][name])
        now = sum(runs["this"][name]) / len(runs["this"][name])
        print(f"| {name} | {ref:,.0f} | {now:,.0f} | {now / ref if ref else float('nan'):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
