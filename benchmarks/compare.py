"""Before and after, same command, same machine: the benchmarks at another commit beside this tree.

    python -m benchmarks.compare dfc55c0                       # sim-b32 and noop-b64, quick runs
    python -m benchmarks.compare dfc55c0 --only sim-b32 --rounds 2
    python -m benchmarks.compare f9e60bf --this 9cd61fb --only minilm-b32-slo50 --full --rounds 2

The other commit is exported (`git archive`) to a temporary directory and run
from there with PYTHONPATH pointing at it, so its daemon, plugins and
benchmark code are all its own; this tree runs as it is, or, with `--this`,
another commit exported the same way (two commits side by side while the
working tree is being changed). Sides alternate
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
    shadow_entry_points(into)
    return into


def shadow_entry_points(tree: Path) -> None:
    """Give `tree` its own `dynbatchd` distribution metadata, built from its pyproject.toml.

    The installed (editable) dynbatchd registers this tree's plugins as entry points; an
    older tree would load them too and fail on hooks it does not know. importlib.metadata
    keeps the first distribution of a name on sys.path, so a dist-info at the front of
    PYTHONPATH makes the other tree load exactly its own plugins."""
    import tomllib
    project = tomllib.loads((tree / "pyproject.toml").read_text())["project"]
    info = tree / f"dynbatchd-{project.get('version', '0')}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: dynbatchd\nVersion: {project.get('version', '0')}\n")
    lines = []
    for group, points in project.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in points.items()]
    scripts = project.get("scripts", {})
    if scripts:
        lines.append("[console_scripts]")
        lines += [f"{name} = {target}" for name, target in scripts.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


def run_side(tree: Path, only: str, quick: bool) -> dict[str, tuple[float, float | None, float | None]]:
    """(goodput req/s, daemon CPU µs per request at its highest fixed rate, the daemon's mean batch
    there) per scenario, from one `benchmarks.run_all` in `tree`. The mean batch is printed beside
    the CPU: a request's share of a batch's cost depends on it, so two sides that batched
    differently at the same rate are not comparing the same work."""
    command = [sys.executable, "-m", "benchmarks.run_all", "--only", only, "--quiet-wait", "5"] + (["--quick"] if quick else [])
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    found = re.search(r"^results: (.+)$", out.stdout, re.M)
    if out.returncode != 0 or not found:
        raise SystemExit(f"benchmarks failed in {tree}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    doc = json.loads(Path(found.group(1)).read_text())
    out = {}
    for s in doc["scenarios"]:
        fixed = s.get("fixed") or []
        cpu = fixed[-1]["cpu"].get("daemon_us_per_req") if fixed else None
        batch = fixed[-1]["cpu"].get("daemon_mean_batch") if fixed else None
        out[s["name"]] = (s.get("goodput_rps") or 0.0, cpu, batch)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("ref", help="the commit to compare this tree with")
    ap.add_argument("--only", default="sim-b32,noop-b64", help="scenarios (default: sim-b32,noop-b64)")
    ap.add_argument("--rounds", type=int, default=1, help="alternating runs per side (default 1)")
    ap.add_argument("--full", action="store_true", help="full-length runs instead of --quick")
    ap.add_argument("--this", metavar="COMMIT", help="run this commit (exported) instead of the working tree")
    args = ap.parse_args(argv)
    head = args.this or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                       text=True).stdout.strip()
    dirty = not args.this and bool(subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", "dynbatchd", "plugins"],
        cwd=REPO, capture_output=True, text=True).stdout.strip())
    print("python -m benchmarks.compare " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])))
    print(f"{os.cpu_count()} cores; ref {args.ref} vs this tree at {head}{' (dirty)' if dirty else ''}")
    runs: dict[str, dict[str, list[tuple[float, float | None, float | None]]]] = {"ref": {}, "this": {}}
    with tempfile.TemporaryDirectory(prefix="dynbatchd-ref-") as tmp:
        ref_tree = export(args.ref, Path(tmp) / "ref")
        this_tree = export(args.this, Path(tmp) / "this") if args.this else REPO
        for round_ in range(args.rounds):
            for side, tree in (("ref", ref_tree), ("this", this_tree)):
                for name, (goodput, cpu, batch) in run_side(tree, args.only, not args.full).items():
                    runs[side].setdefault(name, []).append((goodput, cpu, batch))
                    print(f"  round {round_ + 1} {side:>4} {name}: goodput {goodput:,.0f} req/s"
                          + (f", daemon {cpu} µs/request" if cpu is not None else "")
                          + (f" (mean batch {batch})" if batch is not None else ""), flush=True)

    def mean(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return sum(known) / len(known) if known else None

    print(f"\n| scenario | goodput {args.ref} | goodput {head} | ratio | daemon µs/req {args.ref} | "
          f"daemon µs/req {head} | ratio |\n|---|---|---|---|---|---|---|")
    for name in runs["ref"]:
        g0, g1 = (mean([r[0] for r in runs[side][name]]) for side in ("ref", "this"))
        c0, c1 = (mean([r[1] for r in runs[side][name]]) for side in ("ref", "this"))
        cpu = f"{c0:.1f} | {c1:.1f} | {c1 / c0:.2f}" if c0 and c1 else "| |"
        print(f"| {name} | {g0:,.0f} | {g1:,.0f} | {g1 / g0 if g0 else float('nan'):.2f} | {cpu} |")
    for name in runs["ref"]:   # a round where no rate passed pulls a mean down: say so beside it
        for side, label in (("ref", args.ref), ("this", head)):
            failed = sum(1 for r in runs[side][name] if not r[0])
            if failed:
                print(f"{name}: {failed} of {len(runs[side][name])} rounds of {label} passed no rate (goodput 0 in "
                      "its mean): read the rounds above, not the mean")
    for name in runs["ref"]:   # the spread: each round's CPU ratio (sides run one after the other)
        pairs = [(r[1], t[1]) for r, t in zip(runs["ref"][name], runs["this"][name]) if r[1] and t[1]]
        if pairs:
            print(f"{name}: daemon CPU ratio per round " + ", ".join(f"{t / r:.2f}" for r, t in pairs)
                  + "; mean batch ref " + ", ".join(str(r[2]) for r in runs["ref"][name])
                  + " / this " + ", ".join(str(t[2]) for t in runs["this"][name]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
