"""The metrics port against a hostile client, over a real socket: a request line or a header past the
reader's 64 KiB limit is answered 431 and closed, with no traceback in the log (it once escaped the
handler: no answer, and asyncio logged an ERROR), and the port still serves the next scrape; a
client that never reads its answer loses its connection after ANSWER_TIMEOUT_S."""

from __future__ import annotations

import asyncio
import logging

import pytest

from dynbatchd import metrics, metrics_endpoint

HUGE = b"v" * 70_000   # past asyncio's StreamReader limit (64 KiB)


async def scrape(port: int, request: bytes) -> bytes:
    """Send `request` on a new connection and read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return answer


@pytest.mark.parametrize("request_bytes", [
    b"GET /metrics?" + HUGE + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + HUGE + b"\r\n\r\n",
], ids=["request-line", "header"])
def test_a_line_past_the_limit_is_431_without_a_traceback(request_bytes, caplog):
    async def run():
        server = await metrics.serve("127.0.0.1:0", lambda: "# the page\n")
        port = server.sockets[0].getsockname()[1]
        try:
            return (await scrape(port, request_bytes),
                    await scrape(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"))
        finally:
            server.close()
            await server.wait_closed()

    with caplog.at_level(logging.DEBUG):
        refused, served = asyncio.run(run())
    assert refused.startswith(b"HTTP/1.1 431 "), refused[:200]
    assert served.startswith(b"HTTP/1.1 200 ") and served.endswith(b"# the page\n"), served[:200]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_scraper_that_never_reads_its_answer_gives_its_connection_back(loop, monkeypatch):
    """A client that asked for the page and never read it held its connection for good: the answer's
    drain had no limit, and a transport closed with bytes unsent waits to send them. Now after
    ANSWER_TIMEOUT_S the connection is dropped (its descriptor closed), and the port serves on."""
    import os
    import socket

    monkeypatch.setattr(metrics_endpoint, "ANSWER_TIMEOUT_S", 0.3)
    page = "x" * (32 << 20)   # far more than the socket buffers of both ends hold

    def sockets() -> int:
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
            except OSError:   # (the listing's own descriptor, closed by now)
                pass
        return count

    async def run():
        server = await metrics.serve("127.0.0.1:0", lambda: page)
        port = server.sockets[0].getsockname()[1]
        try:
            before = sockets()
            stuck = socket.socket()
            stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stuck.connect(("127.0.0.1", port))
            stuck.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            for wanted in (before + 2, before + 1):   # the server's end taken, then dropped: only the client's left
                while sockets() != wanted:
                    assert loop.time() < deadline, f"never {wanted - before} sockets: the server kept the connection"
                    await asyncio.sleep(0.05)
            stuck.close()
            return await scrape(port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        finally:
            server.close()
            await server.wait_closed()

    if loop == "uvloop":
        import uvloop
        served = uvloop.run(run())
    else:
        served = asyncio.run(run())
    assert served.startswith(b"HTTP/1.1 200 "), served[:200]
