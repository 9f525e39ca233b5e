"""Connections that fail: what they leave behind, and how they are logged.

- A client that resets its connection mid-body (plain or TLS): the reader kept the
  ConnectionResetError, whose traceback (each read or drain that raised it added frames) held
  the reader: a cycle that kept its buffers, the h11 state and, over TLS, the SSL objects until a
  full collection, which the daemon makes rare (dynbatchd/collector.py). Checked in this process
  under uvloop, as the daemon runs, with the collector off.
- A client that resets its connection while its answer is made: under uvloop the door's write to
  the closed transport raised RuntimeError, logged at ERROR as a failure of the door. Checked end
  to end: it is a hang-up, one INFO line.
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import ssl
import struct
import weakref
from types import SimpleNamespace

import psutil
import pytest
import uvloop

from conftest import free_port, start_daemon, wait_until
from dynbatchd.doors import LocalDoor
from dynbatchd_plugins.http import HttpDoor
from dynbatchd_plugins.http_config import HttpSettings
from test_http_hostile import read_reply
from test_http_keys import self_signed

CONNECTIONS = 12
HEAD = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"


def reset(sock: socket.socket) -> None:
    """Close with a reset (RST), not a FIN: what a client killed, or a load balancer, does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def reset_mid_body(port: int, tls: ssl.SSLContext | None) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=tls)
    writer.write(HEAD + b"part of the body")
    await writer.drain()
    reset(writer.transport.get_extra_info("socket"))
    writer.transport.abort()


@pytest.mark.parametrize("over", ["plain", "tls"])
def test_connections_reset_mid_body_leave_no_reference_cycle(tmp_path, over):
    host = SimpleNamespace(state="serving", config=SimpleNamespace(
        models={}, daemon=SimpleNamespace(keys_dir="", max_request_bytes=4096)))
    tls, files = None, {}
    if over == "tls":
        cert, key = self_signed(tmp_path)
        files = {"tls_cert": str(cert), "tls_key": str(key)}
        tls = ssl.create_default_context(cafile=str(cert))
    port = free_port()
    door = HttpDoor(HttpSettings(listen=f"127.0.0.1:{port}", **files), LocalDoor(host))
    alive: list[weakref.ref] = []   # the server's side of each connection
    ended: asyncio.Queue = asyncio.Queue()
    serve = door._connection

    async def watched(reader, writer):
        alive.append(weakref.ref(reader))
        if over == "tls":
            alive.append(weakref.ref(writer.transport.get_extra_info("ssl_object")))
        try:
            await serve(reader, writer)
        finally:
            ended.put_nowait(None)

    door._connection = watched

    async def run():
        await door.start()
        try:
            for _ in range(CONNECTIONS):
                await reset_mid_body(port, tls)
                await ended.get()   # its connection's task has ended
        finally:
            await door.stop()

    gc.collect()
    gc.disable()
    try:
        uvloop.run(run())
        left = sum(ref() is not None for ref in alive)
    finally:
        gc.enable()
    assert len(alive) == CONNECTIONS * (2 if tls else 1)
    assert left == 0, f"{left} readers or SSL objects of closed connections are held by a reference cycle"


BODY = """
    [models.enc]
    runner = "callable"
    options = { target = "helpers:embed" }
    [channels.held]
    max_batch = 2
    window_ms = 600000
    deadline_ms = 600000
    [routing]
    default = "held"
    [http]
    listen = "127.0.0.1:%d"
"""


def test_a_client_resetting_while_its_answer_is_made_is_a_hang_up_not_a_door_failure(tmp_path):
    port = free_port()
    daemon = start_daemon(tmp_path, BODY % port)
    try:
        queued = lambda: daemon.status()["channels"]["held"]["queue_depth"]   # noqa: E731
        body = json.dumps({"model": "enc", "input": "first"}).encode()
        first = socket.create_connection(("127.0.0.1", port))
        first.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        wait_until(lambda: queued() == 1, 20, message="the first request was never queued")
        client_port = first.getsockname()[1]
        reset(first)
        first.close()

        def closed_by_the_daemon() -> bool:
            return not any(c.laddr and c.laddr.port == port and c.raddr and c.raddr.port == client_port
                           for c in psutil.Process(daemon.pid).net_connections("tcp"))
        wait_until(closed_by_the_daemon, 20, message="the daemon never saw the reset")
        # a second request fills the batch of two: both are answered, the first to a closed connection
        body = json.dumps({"model": "enc", "input": "second"}).encode()
        with socket.create_connection(("127.0.0.1", port)) as second:
            second.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
                           + body)
            status, _ = read_reply(second)
        assert status == 200

        def first_ended() -> str | None:   # the log, once it has the line about the first connection's end
            text = daemon.logs()
            return text if "HTTP connection from" in text or "closed its connection" in text else None
        logs = wait_until(first_ended, 20, message="the first connection's end was never logged")
    finally:
        daemon.stop()
    assert "failed: RuntimeError" not in logs and " ERROR " not in logs, logs[-2000:]
    assert "closed its connection mid-request" in logs
