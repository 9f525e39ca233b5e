"""Open-loop Poisson load over HTTP/1.1: the same request bytes to any server, on a fixed schedule.

The HTTP twin of `benchmarks.loadgen` for `benchmarks.peer`, built the same way: arrival times
drawn up front, every request's bytes built before the clock starts, each request sent when its
time comes whatever the replies do, latency counted from the *scheduled* send time (a late
generator makes latency worse, never better). One request = one `POST` of one input over a
keep-alive connection (asyncio streams, no HTTP library: the generator's own CPU stays small and
is measured). A request goes out on an idle connection; when none is idle a new one is opened
(a pool is opened before the clock starts), up to `max_connections`, past which the request
counts as an error (`client_connections`). Any status but 200 is an error (`http_<status>`), a
connection that breaks is `connection`, no reply by the end of the drain is `missing`.
The result is a `loadgen.RunResult`, summarised by `loadgen.summarise`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import msgspec
import numpy as np

from benchmarks import loadgen

BATCH_KEY = b'"batch_size":'


def post(path: str, host: str, body: bytes) -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (path.encode(), host.encode(), len(body), body))


def embedding_requests(path: str, host: str, model: str, texts: list[str]) -> list[bytes]:
    """One `POST path` per text, body `{"model", "input": text}` (OpenAI embeddings, one input)."""
    return [post(path, host, msgspec.json.encode({"model": model, "input": t})) for t in texts]


def batch_of(body: bytes) -> int:
    """The `batch_size` a reply carries (the peer's worker adds it), else 0."""
    at = body.rfind(BATCH_KEY)
    if at < 0:
        return 0
    at += len(BATCH_KEY)
    end = at
    while end < len(body) and body[end:end + 1].isdigit():
        end += 1
    return int(body[at:end]) if end > at else 0


class _Run:
    """The state of one open-loop run (arrays indexed by request)."""

    def __init__(self, n: int):
        self.done = np.full(n, np.nan)
        self.ok = np.zeros(n, dtype=bool)
        self.codes: list[str | None] = [None] * n
        self.batch = np.zeros(n, dtype=np.int32)
        self.sent_lag = np.zeros(n)
        self.opened = 0          # connections opened during the run (beyond the pool)


async def _exchange(run: _Run, i: int, conn: tuple, request: bytes, idle: deque, t0: float) -> None:
    reader, writer = conn
    try:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length, close = 0, False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                close = True
        body = await reader.readexactly(length) if length else b""
        run.done[i] = time.perf_counter() - t0
        status = int(head[9:12])
        if status == 200:
            run.ok[i] = True
            run.batch[i] = batch_of(body)
        else:
            run.codes[i] = f"http_{status}"
        if close:
            writer.close()
        else:
            idle.append(conn)
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
        run.done[i] = time.perf_counter() - t0
        run.codes[i] = "connection"
        writer.close()


async def _open_loop(host: str, port: int, offsets: np.ndarray, requests: list[bytes], *, pool: int,
                     max_connections: int, drain_s: float, duration_s: float) -> tuple[_Run, float, float, int]:
    n = len(offsets)
    run = _Run(n)
    idle: deque = deque()
    conns: list[Any] = []
    for _ in range(pool):
        conn = await asyncio.open_connection(host, port)
        conns.append(conn)
        idle.append(conn)
    tasks: set[asyncio.Task] = set()
    loop = asyncio.get_running_loop()
    clock = time.perf_counter
    await asyncio.sleep(0.05)
    cpu0 = time.process_time()
    t0 = clock() + 0.01
    due = offsets + t0
    i = 0
    while i < n:
        now = clock()
        while i < n and due[i] <= now:
            if idle:
                conn = idle.pop()
            elif len(conns) < max_connections:
                try:
                    conn = await asyncio.open_connection(host, port)
                except OSError:
                    run.codes[i], run.done[i] = "connection", clock() - t0
                    i += 1
                    continue
                conns.append(conn)
                run.opened += 1
            else:
                run.codes[i], run.done[i] = "client_connections", clock() - t0
                i += 1
                continue
            run.sent_lag[i] = now - due[i]
            task = loop.create_task(_exchange(run, i, conn, requests[i % len(requests)], idle, t0))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        if i < n:
            await asyncio.sleep(max(0.0, due[i] - clock()))
    if tasks:
        await asyncio.wait(set(tasks), timeout=max(0.0, t0 + duration_s + drain_s - clock()))
    elapsed = clock() - t0
    cpu = time.process_time() - cpu0
    for task in list(tasks):
        task.cancel()
    for _, writer in conns:
        writer.close()
    await asyncio.sleep(0)
    return run, elapsed, cpu, len(conns)


def run(host: str, port: int, requests: list[bytes], rate: float, duration_s: float, *, seed: int = 1,
        warmup_s: float = 0.5, drain_s: float = 3.0, pool: int = 64, max_connections: int = 900,
        simulated: bool = False) -> loadgen.RunResult:
    """One open-loop Poisson run at `rate` requests/s for `duration_s` (request i sends
    requests[i % len]); then up to `drain_s` for the last replies."""
    offsets = loadgen.schedule(rate, duration_s, seed)
    r, elapsed, cpu, conns = asyncio.run(_open_loop(host, port, offsets, requests, pool=pool,
                                                    max_connections=max_connections, drain_s=drain_s,
                                                    duration_s=duration_s))
    errors: dict[str, int] = {}
    for code in r.codes:
        if code is not None:
            errors[code] = errors.get(code, 0) + 1
    missing = int(np.isnan(r.done).sum())
    if missing:
        errors[loadgen.MISSING] = missing
    result = loadgen.summarise(rate, duration_s, warmup_s, offsets, r.done, r.ok, r.batch, r.sent_lag, errors,
                               0, 0, simulated, cpu, elapsed)
    sizes = r.batch[r.ok & (r.batch > 0)]
    per_batch = round(float(len(sizes) / (1.0 / sizes).sum()), 2) if len(sizes) else 0.0
    result.extra.update(connections=conns, opened_during_run=r.opened, per_batch_mean=per_batch)
    return result
