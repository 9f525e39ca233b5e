"""Per-batch overhead of a device on a Ray actor against a local worker over ipc://, side by side.

    .venv/bin/python -m benchmarks.ray_overhead [--batches 300] [--sizes 1,16,64]

Both pools run the `noop` runner (it answers at once), so the round trip measured, from the pool's
`send` of an encoded batch to its `on_result`, is the transport's own cost: a ZeroMQ ipc:// message
to a worker process, or a Ray actor call (object store, raylet, gRPC) on a local Ray cluster this
script starts. Batches go one at a time; text inputs of 32 characters. Figures are real timings
of this machine, not simulated; they name the commit and this command.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time

import zmq

from dynbatchd import protocol as P
from dynbatchd.config import RaySettings
from dynbatchd.devices.pool import DevicePool
from dynbatchd.devices.ray_pool import RayDevicePool, import_ray

MODELS = [P.ModelSpec("noop", "noop", {})]


def encoded(batch_id: int, size: int) -> list[bytes]:
    items = [P.BatchItem(text="x" * 32, tokens=8) for _ in range(size)]
    return [P.encoder.encode(P.BatchMsg(batch_id, "noop", items))]


async def round_trips(make_pool, sizes: list[int], batches: int) -> dict[int, list[float]]:
    """Milliseconds from send to result for `batches` batches of each size, after a warm-up."""
    done: dict[int, asyncio.Event] = {}
    ready = asyncio.Event()
    pool = make_pool(on_result=lambda i, r, f: done[r.batch_id].set(), on_lost=lambda i: False,
                     on_ready=lambda i: ready.set(), on_gone=lambda i: None)
    await pool.start(timeout_s=300)
    await ready.wait()
    out: dict[int, list[float]] = {}
    batch_id = 0
    try:
        for size in sizes:
            times = []
            for n in range(batches + 20):          # the first 20 warm the path up and are not counted
                batch_id += 1
                done[batch_id] = asyncio.Event()
                start = time.perf_counter()
                assert pool.send(0, encoded(batch_id, size))
                await done[batch_id].wait()
                if n >= 20:
                    times.append((time.perf_counter() - start) * 1000)
            out[size] = times
    finally:
        await pool.stop()
    return out


def local_pool(ctx: zmq.Context, ipc_dir: str):
    def make(**callbacks):
        return DevicePool(ctx, ["cpu"], MODELS, cpu_threads=1, ipc_dir=ipc_dir, restart_limit=1, **callbacks)
    return make


def ray_pool():
    settings = RaySettings(cpus=1)

    def make(**callbacks):
        return RayDevicePool(None, settings.device_names(), MODELS, cpu_threads=1, ipc_dir="", restart_limit=1,
                             ray=settings, **callbacks)
    return make


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=300, help="timed batches per size and pool (default 300)")
    parser.add_argument("--sizes", default="1,16,64", help="batch sizes, comma-separated (default 1,16,64)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    ray = import_ray()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024 * 1024, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="dynbatchd-bench-") as ipc_dir:
            local = asyncio.run(round_trips(local_pool(zmq.Context.instance(), ipc_dir), sizes, args.batches))
        remote = asyncio.run(round_trips(ray_pool(), sizes, args.batches))
    finally:
        ray.shutdown()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# per-batch round trip, noop runner, one batch at a time ({args.batches} batches per row)")
    print(f"# commit {commit}; command: .venv/bin/python -m benchmarks.ray_overhead "
          f"--batches {args.batches} --sizes {args.sizes}")
    print("| batch | local ipc p50 ms | Ray actor p50 ms | ratio p50 | local p99 ms | Ray p99 ms | ratio p99 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size in sizes:
        lp50, rp50 = statistics.median(local[size]), statistics.median(remote[size])
        lp99, rp99 = p(local[size], 99), p(remote[size], 99)
        print(f"| {size} | {lp50:.3f} | {rp50:.3f} | {rp50 / lp50:.1f}x | {lp99:.3f} | {rp99:.3f} | "
              f"{rp99 / lp99:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
