"""Clients that stop reading their answer: the door must not keep their sockets. A transport's close
first sends what it still holds, which a client whose window stays shut never takes, so a connection
closed after its answer timed out (body_timeout_s) held its descriptor forever, no longer counted
against max_connections: 40 such clients took 37 of the daemon's descriptors for good. Now an answer
not sent in time is aborted, and a graceful close waits body_timeout_s at most.

End to end against a daemon (its descriptors counted in /proc), and in this process under uvloop (as
the daemon runs) where a test needs a server socket's send buffer small or a scripted stream."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path

import msgspec
import uvloop

from conftest import free_port, start_daemon
from helpers import wait_until
from test_http_generate import FakeHost, Quotas, final

from dynbatchd import protocol as P
from dynbatchd.doors import LocalDoor
from dynbatchd_plugins.http import HttpDoor
from dynbatchd_plugins.http_config import HttpSettings

ECHO = """
    [models.echo]
    runner = "callable"
    options = { target = "helpers:echo_or_fail" }
    [channels.standard]
    max_batch = 16
    window_ms = 2
    [routing]
    default = "standard"
    [http]
    listen = "127.0.0.1:%d"
    max_connections = 8
    body_timeout_s = 1.0
    header_timeout_s = 1.0
"""


def kernel_send_buffer_max() -> int:
    """The most a socket's send buffer grows to (tcp_wmem's third value): an answer larger than twice
    it cannot all leave the daemon's process while the client reads nothing."""
    try:
        return int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, IndexError, ValueError):
        return 4 << 20


def sockets(pid: int | str) -> int:
    """The sockets among a process's descriptors (others, eventfds, come and go with its threads)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:   # closed meanwhile
            pass
    return count


def not_reading(port: int, data: bytes) -> socket.socket:
    """A connection that sends `data` and then reads nothing (its receive buffer as small as may be)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect(("127.0.0.1", port))
    sock.sendall(data)
    return sock


def test_an_answer_the_client_never_reads_is_aborted_and_frees_its_descriptor(tmp_path):
    """Six clients ask for answers larger than the kernel can buffer and read nothing: once each timed
    out, the daemon holds none of their sockets, though the clients still hold theirs."""
    size = 2 * kernel_send_buffer_max() + (1 << 20)
    count = size // 100_000 + 1
    port = free_port()
    daemon = start_daemon(tmp_path, ECHO % port, daemon_extra=f"max_request_bytes = {size + (1 << 20)}")
    body = json.dumps({"inputs": [{"name": "t", "datatype": "BYTES", "shape": [count],
                                   "data": ["w" * 100_000] * count}]}).encode()
    head = (f"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    clients = []
    try:
        before = sockets(daemon.pid)
        clients = [not_reading(port, head + body) for _ in range(6)]
        wait_until(lambda: daemon.logs().count("did not take its answer") == 6, 120,
                   message="the answers never timed out")
        wait_until(lambda: sockets(daemon.pid) <= before + 1, 30,
                   message=lambda: f"{sockets(daemon.pid) - before} more sockets held for clients "
                                   "whose answers timed out")
        clients[0].settimeout(30)
        assert clients[0].recv(15).startswith(b"HTTP/1.1 200")   # (the answer began: it was large, not refused)
    finally:
        for sock in clients:
            sock.close()
        assert daemon.stop() == 0
    assert "Traceback" not in daemon.logs()


# -- in this process, under uvloop ------------------------------------------------------------------

async def until(predicate, timeout_s: float, message: str) -> None:
    """Poll `predicate` on the loop until it holds; AssertionError(`message`) after `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"{message} (after {timeout_s:g} s)") from None


class SmallSendBuffer(HttpDoor):
    """The door with each connection's kernel send buffer made small, so that an answer of a few tens
    of KiB stays mostly in the transport when the client reads nothing."""

    async def _serve(self, reader, writer):
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        await super()._serve(reader, writer)


async def open_door(host: FakeHost, door_class=HttpDoor) -> HttpDoor:
    host.quotas = Quotas()
    door = door_class(HttpSettings(listen="127.0.0.1:0", header_timeout_s=0.5, body_timeout_s=0.5), LocalDoor(host))
    await door.start()
    door.port = door._server.sockets[0].getsockname()[1]
    return door


def completion(body: dict) -> bytes:
    raw = msgspec.json.encode(body)
    return (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(raw)) + raw


def test_a_stream_whose_client_stops_reading_ends_withdrawn_and_frees_its_socket():
    """Events pushed faster than a client reads (none): each must be taken within body_timeout_s,
    so the stream ends, its request is withdrawn, its slot and its socket are freed."""
    async def main():
        host = FakeHost()
        door = await open_door(host)
        before = sockets("self")
        client = not_reading(door.port, completion({"model": "gen", "prompt": "x", "stream": True}))
        try:
            await host.arrived.wait()
            envelope, request = host.requests[0]
            for i in range(3 * kernel_send_buffer_max() // 1_000_000 + 4):
                envelope.push(P.Chunk(request.id, i, "x" * 1_000_000, 1))
            await until(lambda: host.cancels, 30, "the stream was never withdrawn")
            await until(lambda: not door._connections and door._in_progress == 0, 30, "its slot was kept")
            await until(lambda: sockets("self") <= before + 1, 30, "the server's socket was kept")
            return host.cancels, request.id
        finally:
            client.close()
            await door.stop()

    cancels, rid = uvloop.run(main())
    assert cancels == [rid]


def test_an_answer_left_unsent_when_a_connection_closes_is_dropped_within_body_timeout_s():
    """A whole answer the transport holds (under its high-water mark, so nothing waited for it) when
    the idle connection closes (header_timeout_s): the close waits body_timeout_s at most, then aborts."""
    async def main():
        host = FakeHost()
        door = await open_door(host, SmallSendBuffer)
        before = sockets("self")
        client = not_reading(door.port, completion({"model": "gen", "prompt": "x"}))
        try:
            await host.arrived.wait()
            host.requests[0][0].settle(final("x" * 60_000))
            await until(lambda: not door._connections, 30, "the connection was never closed")
            await until(lambda: sockets("self") <= before + 1, 30, "the server's socket was kept")
        finally:
            client.close()
            await door.stop()

    uvloop.run(main())
