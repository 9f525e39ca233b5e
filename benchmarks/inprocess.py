"""The daemon's own request path in one process, beside another commit: CPU a request, no sockets.

    python -m benchmarks.inprocess                         # this tree: µs a request at batches of 1, 2, 8
    python -m benchmarks.inprocess --ref 5a432a6 --rounds 3
    python -m benchmarks.inprocess --profile 2             # cProfile of the path at batches of 2

A real `Daemon` is built from a no-op config (runner noop, one channel of max_batch 64) and
driven by hand: each round hands `batch` encoded requests to its FrontEnd's message handler
(decode, validate, intake, engine), runs the scheduling passes it asks for, decodes each
dispatched batch as a worker would and hands its result back (`_on_result`: the engine's
completion, the replies encoded). The sockets are stand-ins that drop what is sent, and the
clock is fake, so the figures hold the daemon's Python work only: no ZeroMQ, no event loop,
no worker process. On a shared machine that is the part that can be compared closely: the
best of `--reps` timed runs (process CPU time) moves by a few per cent, where a live run
(`benchmarks.compare`) moves by 10-20%. `--ref` runs the same driver against another
commit's tree (exported as `benchmarks.compare` does), sides alternating; the driver speaks
both the current engine and the one before the feeders (5a432a6).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NOOP_CHANNEL = {"max_batch": 64, "window_ms": 0.0, "deadline_ms": 1000.0, "queue_limit": 65536}


class _Loop:
    """The event loop's two calls the daemon makes on this path, run by hand."""

    def __init__(self) -> None:
        self.soon: list = []

    def call_soon(self, f, *args):
        self.soon.append((f, args))

    def call_later(self, delay, f, *args):
        return _Handle()

    def run(self) -> None:
        while self.soon:
            f, args = self.soon.pop(0)
            f(*args)


class _Handle:
    def cancel(self) -> None:
        pass


class _Sink:
    """A socket stand-in: what is sent is dropped (FrontEnd.io) or kept for the fake worker (the pool)."""

    def __init__(self) -> None:
        self.batches: list = []
        self.replies = 0

    def send(self, *args) -> bool:   # FrontEnd.io.send(frames) and DevicePool.send(worker, frames)
        if len(args) == 2:
            self.batches.append(args)
        else:
            self.replies += 1
        return True

    def kick(self) -> None:
        pass


def build():
    """A Daemon of this tree's (or `--ref`'s: the importable one) wired to stand-ins: (daemon, front, pool, loop)."""
    from benchmarks.harness import config_text
    from dynbatchd.cli.dynbatchd import load_checked
    from dynbatchd.service import Daemon
    from dynbatchd.transport import FrontEnd

    tmp = tempfile.mkdtemp(prefix="dynbatchd-inprocess-")
    atexit.register(shutil.rmtree, tmp, True)   # the config and the daemon's state files
    path = Path(tmp) / "dynbatchd.toml"
    path.write_text(config_text(tmp, {"noop": {"runner": "noop"}}, NOOP_CHANNEL))
    config, plugins = load_checked(path)
    ticks = [10**12]

    def clock() -> int:
        ticks[0] += 2000   # 2 µs a reading
        return ticks[0]

    daemon = Daemon(config, plugins, config_path=str(path), clock=clock)
    loop = daemon.loop = _Loop()
    front = FrontEnd.__new__(FrontEnd)   # its handlers, not its socket
    front.unauthenticated = front.dropped = front.bad_requests = 0
    front.curve, front.max_request_bytes, front.peer = False, 1 << 20, None
    front.handler, front.io, front.clock = daemon.on_request, _Sink(), clock
    daemon.front = front
    if hasattr(daemon, "intake"):
        daemon.intake.curve = False
    daemon.pool = _Sink()
    daemon.state = "serving"
    if len(inspect.signature(daemon.engine.device_up).parameters) == 2:
        daemon.engine.device_up(0, 0)   # (device, feeder)
    else:
        daemon.engine.device_up(0)
    return daemon, front, daemon.pool, loop


def driver(batch: int):
    """A function running `rounds` rounds of `batch` requests through a fresh daemon (it returns the
    requests sent), and the front end's socket stand-in (its `replies` counts what was answered)."""
    import msgspec

    from dynbatchd import protocol as P

    daemon, front, pool, loop = build()
    bodies = [P.encoder.encode(P.Request(id=i, model="noop", text="hello world")) for i in range(batch)]

    def run(rounds: int) -> int:
        for _ in range(rounds):   # (each round is answered before the next: its ids may repeat)
            front._on_messages([[b"client%d" % (i % 4), body] for i, body in enumerate(bodies)])
            loop.run()
            while pool.batches:
                worker, frames = pool.batches.pop(0)
                msg = msgspec.msgpack.decode(frames[0], type=P.BatchMsg)
                daemon._on_result(worker, P.BatchResult(msg.batch_id, 1500, values=["ok"] * len(msg.items)), [])
                loop.run()
        return rounds * batch
    return run, front.io


def measure(batches: list[int], reps: int, requests: int) -> dict[str, float]:
    """µs of process CPU a request at each batch size: the best of `reps` runs of `requests` requests."""
    out = {}
    for batch in batches:
        run, _ = driver(batch)
        run(max(1, 1000 // batch))   # warm: the cost model settles, the caches fill
        best = float("inf")
        for _ in range(reps):
            gc.collect()
            t0 = time.process_time()
            n = run(max(1, requests // batch))
            best = min(best, (time.process_time() - t0) / n)
        out[str(batch)] = round(best * 1e6, 2)
    return out


def profile(batch: int, requests: int, top: int, out: str | None = None) -> None:
    import cProfile
    import pstats

    run, _ = driver(batch)
    run(max(1, 1000 // batch))
    prof = cProfile.Profile()
    prof.enable()
    n = run(max(1, requests // batch))
    prof.disable()
    stats = pstats.Stats(prof)
    calls = sum(v[1] for v in stats.stats.values())
    print(f"batches of {batch}: {calls / n:.1f} function calls a request (deterministic: compare them across commits)")
    if out:
        stats.dump_stats(out)
    stats.sort_stats("tottime").print_stats(top)


def run_tree(tree: Path, batches: str, reps: int, requests: int) -> dict[str, float]:
    """`measure` in a child process whose dynbatchd is `tree`'s."""
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, __file__, "--child", "--batches", batches, "--reps", str(reps),
                          "--requests", str(requests)], cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"in-process run failed in {tree}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.inprocess", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", help="another commit to run beside this tree")
    ap.add_argument("--batches", default="1,2,8", help="batch sizes (requests a round; default 1,2,8)")
    ap.add_argument("--reps", type=int, default=5, help="timed runs a batch size, the best kept (default 5)")
    ap.add_argument("--requests", type=int, default=20000, help="requests a timed run (default 20000)")
    ap.add_argument("--rounds", type=int, default=1, help="with --ref: alternating runs a side (default 1)")
    ap.add_argument("--profile", type=int, metavar="BATCH", help="cProfile this tree's path at batches of BATCH")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", help="with --profile: keep the stats file here (python -m pstats FILE)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        print(json.dumps(measure(batches, args.reps, args.requests)))
        return 0
    if args.profile:
        profile(args.profile, args.requests, args.top, args.out)
        return 0
    if not args.ref:
        for batch, us in measure(batches, args.reps, args.requests).items():
            print(f"batches of {batch}: {us} µs a request")
        return 0
    from benchmarks.compare import export

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    print(f"python -m benchmarks.inprocess --ref {args.ref}: {os.cpu_count()} cores; this tree at {head}")
    sides: dict[str, list[dict[str, float]]] = {"ref": [], "this": []}
    with tempfile.TemporaryDirectory(prefix="dynbatchd-ref-") as tmp:
        ref_tree = export(args.ref, Path(tmp))
        for round_ in range(args.rounds):
            for side, tree in (("ref", ref_tree), ("this", REPO)):
                sides[side].append(run_tree(tree, args.batches, args.reps, args.requests))
                print(f"  round {round_ + 1} {side:>4}: " + ", ".join(f"batch {b} {us} µs" for b, us in sides[side][-1].items()),
                      flush=True)
    print(f"\n| batch | µs a request {args.ref} | µs a request {head} | ratio |\n|---|---|---|---|")
    for b in (str(b) for b in batches):
        r, t = (min(run[b] for run in sides[side]) for side in ("ref", "this"))
        print(f"| {b} | {r} | {t} | {t / r:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
