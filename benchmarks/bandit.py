"""The online tuner (the ``bandit`` window policy) against ``slo`` and the best fixed setting
(every figure SIMULATED: the daemon's engine on the simulated device, a virtual clock).

    python -m benchmarks.bandit            # phased trace and the Azure production trace
    python -m benchmarks.bandit --quick    # shorter traces, same shape
    python -m benchmarks.bandit --tune     # also: tune --auto's search against the full grid

Traces, devices and channels are those of benchmarks/adaptive.py (sections 1 and 3a): the best
fixed setting is the best of its grid (max_batch 4/8/16/32 x window 10/50/100/200 ms) on the
same trace, found after the fact, which no running daemon can know in advance; ``slo`` and
``bandit`` run with max_batch 32, window_ms 50 (the bound the bandit's arms stay within).
Printed: on-time throughput, on-time share, p99 (misses as +inf), and the ratios side by side.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from typing import Any

from benchmarks import adaptive, traces
from benchmarks.adaptive import SIM, Registry, Setup

ADAPTIVE = ("slo", "bandit")


def _row(name: str, total: Any) -> dict[str, Any]:
    return {"setup": name, "goodput_rps": total.goodput_rps, "on_time": total.on_time_fraction,
            "p99_ms": total.p99_success_ms}


def phased_rows(reg: Registry, quick: bool) -> tuple[str, list[dict[str, Any]]]:
    trace = traces.phased(seconds=(2.0, 1.0, 2.0) if quick else (4.0, 2.0, 4.0))
    lo, hi = trace.phases[0][1], trace.phases[-1][2]
    base = dict(deadline_ms=adaptive.PHASED_SLO_MS, queue_limit=4096)

    def run(setup: Setup) -> dict[str, Any]:
        r = adaptive.run_sim(reg, {"standard": setup.settings(**base)}, trace, device=adaptive.PHASED_DEVICE,
                             devices=1, inflight=2)
        return _row(setup.name, r.total(lo, hi))
    return trace.description, _compare(run)


def azure_rows(reg: Registry, quick: bool) -> tuple[str, list[dict[str, Any]]] | None:
    if not traces.azure_available():
        return None
    trace = adaptive.azure_trace(quick)
    lo, hi = trace.phases[0][1], trace.phases[-1][2]

    def run(setup: Setup) -> dict[str, Any]:
        r = adaptive.run_sim(reg, adaptive.azure_channels(setup), trace, device=adaptive.AZURE_DEVICE, devices=1,
                             inflight=2, routing=adaptive.AZURE_ROUTING, plugins=reg.plugins)
        return _row(setup.name, r.total(lo, hi))
    return f"{trace.description}; {len(trace.arrivals)} requests", _compare(run)


def _compare(run) -> list[dict[str, Any]]:
    fixed = [run(s) for s in adaptive.fixed_grid()]
    best = max(fixed, key=lambda r: (r["goodput_rps"], -r["p99_ms"]))
    best = {**best, "setup": f"best fixed ({best['setup'].removeprefix('fixed ')})"}
    return [best] + [run(Setup(w, window=w, max_batch=32, window_ms=50)) for w in ADAPTIVE]


def _ratio(a: float, b: float) -> str:
    if not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return "-"
    return f"{a / b:.3f}x"


def table(rows: list[dict[str, Any]]) -> str:
    bandit = next(r for r in rows if r["setup"] == "bandit")
    lines = [f"{'setup':28} {'on-time rps':>12} {'on time':>9} {'p99 ms':>9} {'bandit/this rps':>16} "
             f"{'bandit/this p99':>16}"]
    for r in rows:
        p99 = f"{r['p99_ms']:.1f}" if math.isfinite(r["p99_ms"]) else "inf"
        lines.append(f"{r['setup']:28} {r['goodput_rps']:12.1f} {100 * r['on_time']:8.2f}% {p99:>9} "
                     f"{_ratio(bandit['goodput_rps'], r['goodput_rps']):>16} {_ratio(bandit['p99_ms'], r['p99_ms']):>16}")
    return "\n".join(lines)


def tune_vs_grid(trials: int = 30) -> str:
    """The search `tune --auto` runs, on a channel whose running setting misses (600 rps of 200-token
    requests, one device of 8 ms + 0.5 ms/request, max_batch 4 / 10 ms), against every setting of
    its space (7 batch sizes x 8 windows x fixed/slo)."""
    from dynbatchd import config as cfgmod
    from dynbatchd.plugins import Plugins
    from dynbatchd.simulate import DeviceModel
    from dynbatchd.tuning.analyzer import ChannelModel
    from dynbatchd.tuning.recommender import BATCHES, POLICIES, WINDOWS_MS, Evaluator, Setting, search

    cfg = cfgmod.with_channel(cfgmod.load(adaptive.REPO / "etc" / "dynbatchd.toml"), "standard",
                              max_batch=4, window_ms=10.0)
    ev = Evaluator(cfg, ChannelModel("standard", DeviceModel(8.0, 0.5, 0.0), 1, 600.0, 200, 20.0), Plugins.load())
    best, score, incumbent, now = search(ev, trials=trials, seed=1)
    grid = {(b, w, p): ev(Setting(b, w, p)) for b in BATCHES for w in WINDOWS_MS for p in POLICIES}
    top_rps, top = max((v.goodput_rps, k) for k, v in grid.items() if v is not None and v.on_time >= 0.99)
    return (f"running {incumbent.as_dict()}: {100 * now.on_time:.1f}% on time, {now.goodput_rps:.1f} on-time rps\n"
            f"search ({trials} trials): {best.as_dict()}: {100 * score.on_time:.1f}% on time, "
            f"{score.goodput_rps:.1f} on-time rps, p99 {score.p99_ms:.0f} ms\n"
            f"grid best of {len(grid)}: {top}: {top_rps:.1f} on-time rps; search / grid = {score.goodput_rps / top_rps:.3f}x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter traces, same shape")
    ap.add_argument("--tune", action="store_true", help="also tune --auto's search against the full grid")
    args = ap.parse_args(argv)
    reg = Registry.load()
    if "bandit" not in reg.windows:
        sys.exit("the bandit window policy is not registered (reinstall: pip install -e .)")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    flags = "".join(f" --{f}" for f in ("quick", "tune") if getattr(args, f))
    print(f"[{SIM}] python -m benchmarks.bandit{flags} at commit {commit or '?'}")
    t0 = time.perf_counter()
    sections = [("phased trace, one simulated device", phased_rows(reg, args.quick)),
                ("Azure conversation trace, one simulated device", azure_rows(reg, args.quick))]
    for title, found in sections:
        if found is None:
            print(f"\n== {title}: skipped, {traces.AZURE_CSV} not found ==")
            continue
        description, rows = found
        print(f"\n== {title} [{SIM}] ==\ntrace: {description}")
        print(table(rows))
    if args.tune:
        print(f"\n== tune --auto's search against the full grid [{SIM}] ==")
        print(tune_vs_grid())
    print(f"\n{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
