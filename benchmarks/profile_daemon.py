"""Where the daemon's own CPU goes: run one scenario's daemon under cProfile at a fixed rate.

    python -m benchmarks.profile_daemon --scenario noop-b64 --rate 5000 --duration 5
    python -m benchmarks.profile_daemon --scenario sim-b32 --rate 1200 --sort cumulative

Prints the daemon's hottest functions (the daemon process only; workers are not profiled)
and the load run's figures. cProfile slows Python code down, so read the proportions, not the
absolute times. The stats file is kept for `python -m pstats FILE`.
"""

from __future__ import annotations

import argparse
import os
import pstats
import tempfile

from benchmarks import loadgen
from benchmarks.harness import RunningDaemon, cpu_delta
from benchmarks.scenarios import all_scenarios


def main(argv: list[str] | None = None) -> int:
    scenarios = {s.name: s for s in all_scenarios()}
    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile_daemon", description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="noop-b64", choices=sorted(scenarios))
    ap.add_argument("--rate", type=float, default=5000.0)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--sort", default="tottime", help="pstats sort key (tottime, cumulative, ncalls)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=None, help="where to keep the stats file")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sc = scenarios[args.scenario]
    out = args.out or os.path.join(tempfile.mkdtemp(prefix="dynbatchd-profile-"), f"{sc.name}.prof")
    with RunningDaemon(sc.name, sc.models, sc.channel, cpu_threads=sc.cpu_threads, profile_to=out) as d:
        loadgen.run(d.endpoint, sc.model, max(10.0, args.rate / 4), 1.0, inputs=sc.inputs, seed=999)
        before = d.cpu()
        r = loadgen.run(d.endpoint, sc.model, args.rate, args.duration, inputs=sc.inputs, seed=1)
        cpu = cpu_delta(before, d.cpu(), r.sent)
    d.cleanup()
    print(f"{sc.name} at {args.rate:g} req/s for {args.duration:g} s (under cProfile): p50 {r.p50_ms} ms, "
          f"p99 {r.p99_ms} ms, errors {r.errors}, mean batch {r.mean_batch}; daemon {cpu['daemon_us_per_req']} "
          f"us/req, workers {cpu['workers_us_per_req']} us/req")
    stats = pstats.Stats(out)
    stats.sort_stats(args.sort).print_stats(args.top)
    print(f"stats file: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
