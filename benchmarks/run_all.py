"""Every benchmark scenario in one command (`make bench`): goodput, latency, errors, CPU/request.

    python -m benchmarks.run_all                  # full: about 4-6 minutes on 2 cores
    python -m benchmarks.run_all --quick          # shorter runs, fewer search steps
    python -m benchmarks.run_all --only sim-b32,sim-b1

Each scenario starts its own `dynbatchd` (ipc:// sockets in a temp dir), warms it up, searches
for goodput with open-loop Poisson runs, and stops it with SIGTERM. Figures go to stdout and to
benchmarks/results/<time>.json (and latest.json). Simulated-accelerator figures are labelled
SIMULATED: the device is a sleep in the worker process, not hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from dynbatchd.client import DynbatchdError

from benchmarks import loadgen, report
from benchmarks.goodput import find_goodput
from benchmarks.harness import RunningDaemon, cpu_delta, machine_busy_s, wait_for_quiet
from benchmarks.scenarios import Scenario, all_scenarios

RESULTS = Path(__file__).resolve().parent / "results"
NOISY_CORES = 0.25   # a failed run during which other processes used more than this is run once more
MIN_REQUESTS = 1000   # low-rate runs last longer (up to 3x) so that p99 rests on enough samples


def measure_once(d: RunningDaemon, sc: Scenario, rate: float, duration_s: float, seed: int,
                 quiet_wait_s: float = 0.0) -> tuple[loadgen.RunResult, dict[str, Any]]:
    """One open-loop run with CPU accounting around it (after waiting for a quiet machine)."""
    background = wait_for_quiet(quiet_wait_s) if quiet_wait_s > 0 else None
    duration_s = min(max(duration_s, MIN_REQUESTS / rate), 3 * duration_s)
    deadline_s = sc.channel.get("deadline_ms", 1000.0) / 1000
    status0 = d.status()
    st0 = status0["channels"]["bench"]
    busy0, c0 = machine_busy_s(), d.cpu()
    r = loadgen.run(d.endpoint, sc.model, rate, duration_s, inputs=sc.inputs, drain_s=deadline_s + 3.0, seed=seed)
    c1, busy1 = d.cpu(), machine_busy_s()
    status1 = d.status()
    st1 = status1["channels"]["bench"]
    answered = r.sent - r.errors.get(loadgen.MISSING, 0)
    extra = cpu_delta(c0, c1, answered)
    gen_s = r.gen_cpu_frac * r.elapsed_s
    wall = extra["wall_s"]
    others = (busy1 - busy0) - extra["daemon_cpu_s"] - extra["workers_cpu_s"] - gen_s
    extra.update(
        generator_cpu_s=round(gen_s, 3),
        background_cores_before=background,
        other_cores=round(max(0.0, others) / wall, 3) if wall > 0 else None,
        daemon_batches=st1["batches"] - st0["batches"],
        daemon_mean_batch=round((st1["completed"] - st0["completed"]) / max(1, st1["batches"] - st0["batches"]), 2),
        device_busy=round(sum(d1["busy_s"] - d0["busy_s"] for d0, d1 in zip(status0["devices"], status1["devices"]))
                          / max(1e-9, r.elapsed_s), 3),
        daemon_alive=d.alive())
    time.sleep(0.3)
    return r, extra


def detail(r: loadgen.RunResult, extra: dict[str, Any]) -> str:
    """Where one run's time and errors went (printed above its line of `find_goodput`): errors by kind, the daemon's
    queue and compute p50/p99 and the rest (transport), device busy, batches, other load."""
    b = r.extra.get("breakdown_ms", {})
    part = lambda k: f"{b[k]['p50']:.1f}/{b[k]['p99']:.1f}" if k in b else "-"   # noqa: E731
    errors = ", ".join(f"{k} {v}" for k, v in r.errors.items()) or "none"
    return (f"errors: {errors}; ms p50/p99 queue {part('daemon_queue')}, compute {part('compute')}, "
            f"outside {part('outside_daemon')}; device busy {extra.get('device_busy')}, "
            f"batch {extra.get('daemon_mean_batch')}; other load {extra.get('other_cores')} cores")


def run_scenario(sc: Scenario, duration_s: float, quick: bool, quiet_wait_s: float = 0.0, log=print) -> dict[str, Any]:
    log(f"\n== {sc.name}: {sc.title}; SLO p99 <= {sc.slo_ms:g} ms, errors < 0.1 %")
    t_start = time.monotonic()
    seeds = iter(range(1000, 2000))
    with RunningDaemon(sc.name, sc.models, sc.channel, cpu_threads=sc.cpu_threads) as d:
        log(f"   daemon pid {d.pid} serving after {time.monotonic() - t_start:.1f} s: {' '.join(d.command)}")
        loadgen.run(d.endpoint, sc.model, max(10.0, sc.start / 4), 1.0, inputs=sc.inputs, seed=999)  # warm-up
        def measure(rate: float) -> tuple[loadgen.RunResult, dict[str, Any]]:
            r, extra = measure_once(d, sc, rate, duration_s, next(seeds), quiet_wait_s)
            if not r.passes(sc.slo_ms) and (extra["other_cores"] or 0) > NOISY_CORES and quiet_wait_s > 0:
                log(f"    ({rate:g} req/s failed while other processes used {extra['other_cores']} cores: run again)")
                first = {"result": r.to_dict(), "cpu": extra}
                r, extra = measure_once(d, sc, rate, duration_s, next(seeds), quiet_wait_s)
                extra["discarded_noisy_run"] = first
            log("      " + detail(r, extra))
            return r, extra
        search = find_goodput(measure, slo_ms=sc.slo_ms,
                              start=sc.start, factor=sc.factor, probes=sc.probes,
                              refine=max(1, sc.refine - 1) if quick else sc.refine, ceiling=sc.ceiling, log=log)
        fixed = []
        for rate in sc.fixed_rates:
            r, extra = measure(rate)
            log(f"    fixed {rate:>7.1f} req/s: p99 {r.p99_ms:.2f} ms, batch {r.mean_batch:.1f}, daemon "
                f"{extra['daemon_us_per_req']} us/req, workers {extra['workers_us_per_req']} us/req")
            fixed.append({"rate": rate, "result": r.to_dict(), "cpu": extra})
        channel_stats = d.status()["channels"]["bench"]
    d.cleanup()
    best = search.best
    return {
        "name": sc.name, "title": sc.title, "model": sc.model, "simulated": any(t[1].simulated for t in search.trials),
        "config": {"models": sc.models, "channel": sc.channel, "cpu_threads": sc.cpu_threads},
        "slo_ms": sc.slo_ms, "limit_rps": sc.limit, "twin_of": sc.twin_of,
        "goodput_rps": search.goodput,
        "at_goodput": {"result": best[1].to_dict(), "cpu": best[2]} if best else None,
        "trials": [{"rate": rate, "pass": search.passed(r), "result": r.to_dict(), "cpu": extra}
                   for rate, r, extra in search.trials],
        "fixed": fixed,
        "exactly_once": all(t[1].exactly_once and t[2].get("discarded_noisy_run", {}).get("result", {}).get(
            "exactly_once", True) for t in search.trials) and all(f["result"]["exactly_once"] for f in fixed),
        "daemon_exit_code": d.exit_code, "daemon_trouble": d.trouble,
        "daemon_channel_stats": {k: v for k, v in channel_stats.items() if k != "window"},
        "wall_s": round(time.monotonic() - t_start, 1),
    }


def environment() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    cpu_model = ""
    try:
        cpu_model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cores": os.cpu_count(), "cpu": cpu_model, "python": platform.python_version(),
            "kernel": platform.release(), "commit": git("rev-parse", "--short", "HEAD"),
            # daemon sources changed since the commit (edits to the benchmarks and docs themselves don't count)
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks", ":!docs")),
            "loadavg_before": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run_all", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 s runs and one bisection step: about half the time")
    ap.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    ap.add_argument("--duration", type=float, default=None, help="seconds per open-loop run (default 4, quick 2)")
    ap.add_argument("--quiet-wait", type=float, default=15.0,
                    help="before each run, wait up to this many seconds for other load to stop (0: don't)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    duration = args.duration or (2.0 if args.quick else 4.0)
    scenarios = all_scenarios()
    if args.only:
        wanted = {s.strip() for s in args.only.split(",") if s.strip()}
        unknown = wanted - {s.name for s in scenarios}
        if unknown:
            ap.error(f"unknown scenario(s) {', '.join(sorted(unknown))}; known: {', '.join(s.name for s in scenarios)}")
        scenarios = [s for s in scenarios if s.name in wanted]
    if args.quick:
        scenarios = [replace(s, fixed_rates=s.fixed_rates[-1:]) for s in scenarios]
    command = "python -m benchmarks.run_all" + "".join(" " + shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    env = environment()
    print(f"{command}\n{env['cores']} cores ({env['cpu']}), Python {env['python']}, commit {env['commit']}"
          f"{' (dirty)' if env['dirty'] else ''}, load average {env['loadavg_before'][0]:.2f}; {duration:g} s per run")
    t0 = time.monotonic()
    results = []
    for sc in scenarios:
        try:
            results.append(run_scenario(sc, duration, args.quick, args.quiet_wait))
        except (RuntimeError, DynbatchdError) as exc:  # a daemon that would not start or stopped answering
            print(f"   {sc.name} FAILED: {exc}")
            results.append({"name": sc.name, "title": sc.title, "failed": str(exc)})
    doc = {"command": command, "environment": env, "duration_s": duration, "quick": args.quick,
           "wall_s": round(time.monotonic() - t0, 1), "scenarios": results, "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
    doc["summary"] = report.summary(results)
    print()
    print(report.render(doc))
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}.json"
    text = json.dumps(doc, indent=2, default=str)
    path.write_text(text)
    (RESULTS / "latest.json").write_text(text)
    print(f"\nresults: {path}")
    return 0 if all(r.get("exactly_once") for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
