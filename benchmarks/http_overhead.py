"""What the HTTP front door costs: no-op requests over HTTP beside the same over ZeroMQ, one daemon.

    python -m benchmarks.http_overhead                  # 2 rounds x 10 s per side; about 1 min
    python -m benchmarks.http_overhead --concurrency 32 --seconds 20

One daemon (`dynbatchd start`, runner "noop", max_batch 64, window 1 ms) with both its ZeroMQ
socket and `[http] listen`. Closed loop on each side with the same number of requests in flight:
ZeroMQ through `AsyncClient`, HTTP as `POST /v1/embeddings` of one input over keep-alive
connections (a minimal asyncio HTTP/1.1 client here, so the client's cost stays small and equal
in kind). Sides alternate. Printed: requests/s and the daemon's CPU per request on each side,
and the ratios. The load generator shares this machine's cores with the daemon, so compare the
ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import cpu_delta, free_port, ipc_daemon
from dynbatchd.client import AsyncClient

REPO = Path(__file__).resolve().parent.parent


def config(port: int):
    def body(endpoint: str, control: str) -> str:
        return f'''
[daemon]
listen = "{endpoint}"
control = "{control}"
log_level = "warning"
[devices]
use = ["cpu"]
[models.noop]
runner = "noop"
[channels.standard]
max_batch = 64
window_ms = 1
queue_limit = 65536
[routing]
default = "standard"
[http]
listen = "127.0.0.1:{port}"
'''
    return body


async def zeromq_side(endpoint: str, concurrency: int, seconds: float) -> int:
    done = 0
    stop_at = time.perf_counter() + seconds
    async with AsyncClient(endpoint, timeout=30) as client:
        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                await client.infer("noop", "hello world")
                done += 1
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


async def http_side(port: int, concurrency: int, seconds: float) -> int:
    body = json.dumps({"model": "noop", "input": "hello world"}).encode()
    request = (b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    done = 0
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < stop_at:
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                if not head.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(head.split(b"\r\n")[0].decode())
                done += 1
        finally:
            writer.close()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.http_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    print("python -m benchmarks.http_overhead " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    print(f"commit {head}; runner noop, max_batch 64, window 1 ms; {args.concurrency} requests in flight per side\n")
    port = free_port()
    figures: dict[str, list[tuple[float, float]]] = {"ZeroMQ": [], "HTTP": []}
    with tempfile.TemporaryDirectory(prefix="dynbatchd-http-") as tmp:
        with ipc_daemon(tmp, config(port), name="dynbatchd (http overhead)").start(60.0) as daemon:
            asyncio.run(zeromq_side(daemon.endpoint, 8, 1.0))    # warm both paths up
            asyncio.run(http_side(port, 8, 1.0))
            for round_ in range(args.rounds):
                for side in ("ZeroMQ", "HTTP"):
                    before = daemon.cpu()
                    t0 = time.perf_counter()
                    if side == "ZeroMQ":
                        n = asyncio.run(zeromq_side(daemon.endpoint, args.concurrency, args.seconds))
                    else:
                        n = asyncio.run(http_side(port, args.concurrency, args.seconds))
                    wall = time.perf_counter() - t0
                    cpu = cpu_delta(before, daemon.cpu(), n)["daemon_us_per_req"]
                    figures[side].append((n / wall, cpu))
                    print(f"  round {round_ + 1} {side}: {n / wall:,.0f} req/s, daemon {cpu} µs/request", flush=True)

    def mean(values):
        return sum(values) / len(values)

    z_rps, h_rps = mean([r for r, _ in figures["ZeroMQ"]]), mean([r for r, _ in figures["HTTP"]])
    z_cpu, h_cpu = mean([c for _, c in figures["ZeroMQ"]]), mean([c for _, c in figures["HTTP"]])
    print("\n| front door | requests/s | daemon CPU µs/request |\n|---|---|---|")
    print(f"| ZeroMQ | {z_rps:,.0f} | {z_cpu:.1f} |\n| HTTP | {h_rps:,.0f} | {h_cpu:.1f} |")
    print(f"| HTTP / ZeroMQ | {h_rps / z_rps:.2f} | {h_cpu / z_cpu:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
