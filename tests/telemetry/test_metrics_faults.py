"""The metrics port against a hostile client, over a real socket: a request line or a header past the
reader's 64 KiB limit is answered 431 and closed, with no traceback in the log (it once escaped the
handler: no answer, and asyncio logged an ERROR), and the port still serves the next scrape."""

from __future__ import annotations

import asyncio
import logging

import pytest

from dynbatchd import metrics

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
