"""Does a warmup of 10,000 users delay live traffic? Live p99 with and without one, side by side.

    python -m benchmarks.warmup_impact                 # 2 rounds of 20 s each side; about 2 min
    python -m benchmarks.warmup_impact --rounds 3 --rate 400

A real daemon (`dynbatchd start`, runner "simulated": 8 ms + 0.5 ms/item, real sockets) whose
top-users sketch already holds 10,000 users with one input each (written to its state directory
before it starts, as a daemon that has seen a day of traffic would have saved it). Live load:
open-loop Poisson requests to the `standard` channel, every input new (so none is answered from
the cache and each one runs on the device). Sides alternate: a run without warmup,
then a run that starts with `dynbatchctl warmup --top-users 10000` (the inputs run in the
`bulk` warmup channel, which warmup never fills past half its queue), then again. Printed: live
p50/p99 per run, the warmup inputs that ran during it, and the ratio of the p99s.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import loadgen
from benchmarks.harness import ipc_daemon
from dynbatchd.client import control_call
from dynbatchd.topusers import FILE_NAME, TopUsers

REPO = Path(__file__).resolve().parent.parent
USERS = 10_000


def config(state_dir: Path):
    def body(endpoint: str, control: str) -> str:
        return f'''
[daemon]
listen = "{endpoint}"
control = "{control}"
state_dir = "{state_dir}"
log_level = "warning"
[devices]
use = ["cpu"]
[models.sim]
runner = "simulated"
options = {{ base_ms = 8.0, per_item_ms = 0.5 }}
[channels.standard]
max_batch = 32
window_ms = 10
deadline_ms = 1000
priority = 1
queue_limit = 4096
[channels.bulk]
max_batch = 32
window_ms = 50
deadline_ms = 600000
queue_limit = 2048
[routing]
default = "standard"
[cache]
entries = 20000
warmup_channel = "bulk"
[top_users]
users = 20000
inputs_per_user = 1
'''
    return body


def seed_sketch(state_dir: Path) -> None:
    """10,000 users with one input each, the most active first."""
    sketch = TopUsers(users=20_000, inputs_per_user=1)
    for u in range(USERS):
        for _ in range(1 + (USERS - u) // 1000):
            sketch.observe(None, f"user-{u}", "sim", f"what user {u} asks every day")
    state_dir.mkdir(parents=True, exist_ok=True)
    sketch.save(state_dir / FILE_NAME)


def warmed(status: dict) -> int:
    return status["channels"]["bulk"]["warmup"]["items"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.warmup_impact", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=300.0, help="live requests/s (default 300)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per run (default 20)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    print("python -m benchmarks.warmup_impact " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    print(f"commit {head}; SIMULATED device 8 ms + 0.5 ms/item; live {args.rate:g} req/s to standard (max_batch 32, "
          f"window 10 ms); warmup of {USERS:,} users' inputs through bulk (max_batch 32, window 50 ms)\n")
    rows = []
    for round_ in range(args.rounds):   # a fresh daemon each round: its warmup finds nothing cached yet
        with tempfile.TemporaryDirectory(prefix="dynbatchd-warmup-") as tmp:
            state = Path(tmp) / "state"
            seed_sketch(state)
            with ipc_daemon(tmp, config(state), name="dynbatchd (warmup impact)").start(60.0) as daemon:
                loadgen.run(daemon.endpoint, "sim", args.rate, 2.0, seed=99)   # settle the cost model
                for side in ("without warmup", "with warmup"):
                    before = warmed(control_call(daemon.control, "status"))
                    queued = 0
                    if side == "with warmup":
                        queued = control_call(daemon.control, "warmup", top_users=USERS)["queued"]
                    unique = [f"live request {round_}/{side}/{i}" for i in range(int(args.rate * args.duration * 1.5))]
                    r = loadgen.run(daemon.endpoint, "sim", args.rate, args.duration, seed=round_ + 1,
                                    inputs=unique)   # never cached: each one runs on the device
                    ran = warmed(control_call(daemon.control, "status")) - before
                    rows.append((round_ + 1, side, r.p50_ms, r.p99_ms, sum(r.errors.values()), queued, ran))
                    print(f"  round {round_ + 1} {side}: p50 {r.p50_ms:.1f} ms, p99 {r.p99_ms:.1f} ms, "
                          f"errors {r.errors or 0}, warmup queued {queued:,}, ran {ran:,}", flush=True)
    print("\n| round | live traffic | p50 | p99 | errors | warmup inputs queued | warmup inputs run during it |")
    print("|---|---|---|---|---|---|---|")
    for round_, side, p50, p99, errors, queued, ran in rows:
        print(f"| {round_} | {side} | {p50:.1f} ms | {p99:.1f} ms | {errors} | {queued:,} | {ran:,} |")
    without = [p99 for _, side, _, p99, *_ in rows if side == "without warmup"]
    with_ = [p99 for _, side, _, p99, *_ in rows if side == "with warmup"]
    ratio = (sum(with_) / len(with_)) / (sum(without) / len(without))
    print(f"\nlive p99 with warmup / without: {ratio:.2f} (goal: within 1.10)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
