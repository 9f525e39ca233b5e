"""The metrics endpoint: a tiny asyncio HTTP server for `dynbatchd.metrics.render`'s page.

``GET /metrics`` serves the page, ``HEAD /metrics`` its head alone; another method there is 405,
any other path 404. A scrape's head must come within HEAD_TIMEOUT_S, its answer be read within
ANSWER_TIMEOUT_S, and at most MAX_CONNECTIONS are open at once (503 with Retry-After beyond, unread),
so slow clients cannot take the daemon's file descriptors.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

log = logging.getLogger("dynbatchd.metrics")
HEAD_TIMEOUT_S = 5.0   # for a scrape's whole head: a client sending a header a second cannot hold a connection
# For a scrape's whole answer to be taken: a client that asks and never reads once held its connection for
# good (64 of them, the port). Prometheus gives up on a scrape after 10 s by default; a page is not that slow.
ANSWER_TIMEOUT_S = 30.0
# Scrapes served at once: Prometheus sends one per target per interval, so 64 is room for many servers and
# people; beyond it a connection is answered 503 and closed, so that slow clients cannot take every
# file descriptor of the daemon (its sockets, key files and workers need them).
MAX_CONNECTIONS = 64


async def serve(listen: str, page: Callable[[], str]) -> asyncio.AbstractServer:
    """Serve `page()` (Prometheus text) at GET /metrics on `listen` (HOST:PORT)."""
    host, _, port = listen.rpartition(":")
    held = _Connections()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not held.take():
            await _refuse(writer)
            return
        delivered = False
        try:
            try:
                request_line = await _read_head(reader)
            except ValueError:   # a line past the reader's limit: answered, never an unhandled error
                await _answer(writer, "431 Request Header Fields Too Large", b"request line or header too large\n")
                delivered = True
                await _discard(reader, writer)
                return
            status, body, extra = _page_or_404(request_line, page)
            await _answer(writer, status, body, extra, with_body=not request_line.startswith(b"HEAD "))
            delivered = True
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            held.give_back()
            _close(writer, delivered)

    server = await asyncio.start_server(handle, host or "127.0.0.1", int(port))
    log.info("Prometheus metrics on http://%s/metrics", listen)
    return server


class _Connections:
    """The metrics connections open, at most MAX_CONNECTIONS; the first refusal of a run of them is
    logged (one line, the next once the port had room again)."""

    def __init__(self) -> None:
        self.open = 0
        self.refusing = False

    def take(self) -> bool:
        if self.open >= MAX_CONNECTIONS:
            if not self.refusing:
                log.warning("metrics port: %d connections open: further ones answered 503 until one closes",
                            MAX_CONNECTIONS)
            self.refusing = True
            return False
        self.open += 1
        self.refusing = False
        return True

    def give_back(self) -> None:
        self.open -= 1


async def _refuse(writer: asyncio.StreamWriter) -> None:
    """503 without reading the request (a full port must cost nothing more), then close."""
    delivered = False
    try:
        await _answer(writer, "503 Service Unavailable", b"too many metrics connections open\n",
                      "Retry-After: 1\r\n", timeout_s=HEAD_TIMEOUT_S)
        delivered = True
    except (asyncio.TimeoutError, ConnectionError):
        pass
    finally:
        _close(writer, delivered)


def _close(writer: asyncio.StreamWriter, delivered: bool) -> None:
    """Close once the answer went out; else drop the connection at once. A transport closed with
    bytes still unsent waits to send them first, which a client that never reads never lets it do:
    each such connection kept its file descriptor for good, no longer counted as open."""
    if delivered:
        writer.close()
    else:
        writer.transport.abort()


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    """The request line, its headers read and dropped. ValueError: a line past the reader's limit
    (64 KiB; asyncio raises it from readline), which a scraper never sends."""
    async with asyncio.timeout(HEAD_TIMEOUT_S):
        request_line = await reader.readline()
        while (await reader.readline()) not in (b"\r\n", b"\n", b""):
            pass
    return request_line


def _page_or_404(request_line: bytes, page: Callable[[], str]) -> tuple[str, bytes, str]:
    """(status line, body, more header lines): the page for GET (or HEAD) /metrics; 405 naming the
    methods allowed for another method there, else 404."""
    parts = request_line.decode("latin-1").split()
    if not (len(parts) >= 2 and parts[1].split("?")[0] == "/metrics"):
        return "404 Not Found", b"not found: try /metrics\n", ""
    if parts[0] not in ("GET", "HEAD"):
        return "405 Method Not Allowed", b"method not allowed: GET /metrics\n", "Allow: GET, HEAD\r\n"
    try:
        return "200 OK", page().encode(), ""
    except Exception:   # a scrape must get an answer, and the daemon must not lose its loop
        log.exception("could not render the metrics page")
        return "500 Internal Server Error", b"could not render the metrics page: see the daemon's log\n", ""


async def _answer(writer: asyncio.StreamWriter, head: str, body: bytes, extra: str = "", *,
                  with_body: bool = True, timeout_s: float | None = None) -> None:
    """The answer, taken by the client within `timeout_s` (default ANSWER_TIMEOUT_S; else TimeoutError). A HEAD's answer has
    the head alone (its Content-Length the body's): bytes after it would be read as the next answer's start."""
    writer.write(f"HTTP/1.1 {head}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                 f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n".encode()
                 + (body if with_body else b""))
    async with asyncio.timeout(ANSWER_TIMEOUT_S if timeout_s is None else timeout_s):
        await writer.drain()


async def _discard(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, budget: int = 1 << 20) -> None:
    """After answering a head it did not read to its end: drop what the client still sends (up to
    `budget` bytes and HEAD_TIMEOUT_S), so closing with unread data does not reset the connection
    and lose the answer before the client reads it."""
    if writer.can_write_eof():
        writer.write_eof()
    async with asyncio.timeout(HEAD_TIMEOUT_S):
        while budget > 0 and (data := await reader.read(65536)):
            budget -= len(data)
