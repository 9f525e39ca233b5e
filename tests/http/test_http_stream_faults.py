"""Faults a live fuzzing pass found in the HTTP door's generative endpoints, each with the test that
failed before its fix: every completion was followed by an unrequested 500 and a closed connection
(the hang-up watch was cancelled but not awaited, so the connection's next read raised), and the
cap on stop strings and a tiny temperature over HTTP."""

from __future__ import annotations

import asyncio
import json
import socket

import h11
import pytest

from conftest import start_tiny_generative_http

from dynbatchd import protocol as P
from dynbatchd_plugins.httpstream import HttpStreaming
from dynbatchd_plugins.httpwire import ClientGone

FIRST = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"
SECOND = b"GET /second HTTP/1.1\r\nhost: x\r\n\r\n"


def answered_conn() -> h11.Connection:
    """A server connection that has read FIRST to its end (as when the door runs its handler)."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(FIRST)
    while not isinstance(conn.next_event(), h11.EndOfMessage):
        pass
    return conn


async def answer() -> str:
    return "answer"


# -- the hang-up watch, on a real StreamReader ---------------------------------------------------

def test_after_an_answer_the_connections_next_read_is_free():
    async def main():
        reader, conn = asyncio.StreamReader(), answered_conn()
        assert await HttpStreaming._unless_gone(answer(), conn, reader) == "answer"
        asyncio.get_running_loop().call_soon(reader.feed_data, SECOND)   # once the read below waits
        return await reader.read(1024)   # the next request's read (plugins/http.py `_head`) raised here

    assert asyncio.run(main()) == SECOND


def test_bytes_the_watch_read_go_to_h11_for_the_next_request():
    """A pipelined request that the watch read is handed to h11, and is the connection's next request."""
    async def main():
        reader, conn = asyncio.StreamReader(), answered_conn()
        reader.feed_data(SECOND)
        assert await HttpStreaming._unless_gone(answer(), conn, reader) == "answer"
        conn.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
        conn.send(h11.EndOfMessage())
        conn.start_next_cycle()
        reader.feed_eof()
        return conn.next_event(), await reader.read(1024)

    event, left = asyncio.run(main())
    assert isinstance(event, h11.Request) and event.target == b"/second"
    assert left == b""   # taken once, not also left in the reader


def test_a_hang_up_while_the_answer_is_made_withdraws_it():
    async def main():
        reader, conn = asyncio.StreamReader(), answered_conn()
        never = asyncio.get_running_loop().create_future()

        async def waits():
            await never

        reader.feed_eof()
        with pytest.raises(ClientGone):
            await HttpStreaming._unless_gone(waits(), conn, reader)
        return never

    assert asyncio.run(main()).cancelled()


# -- end to end: a real daemon's HTTP door, over one raw keep-alive socket -------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    daemon = start_tiny_generative_http(tmp_path_factory.mktemp("httpfaults"))
    yield daemon
    daemon.stop()


def request(path: str, body: dict, rid: str) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-request-id: {rid}\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode() + data


class Replies:
    """Whole responses read off a socket, each by its content-length (the door sends every JSON
    answer so), whatever the reads' boundaries: a pipelined client's view."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buffer = sock, b""

    def _until(self, size: int) -> None:
        while len(self.buffer) < size:
            data = self.sock.recv(65536)
            assert data, f"the connection closed; it sent {self.buffer[:300]!r}"
            self.buffer += data

    def next(self) -> tuple[int, dict, dict]:
        """(status, headers, JSON body) of the next response."""
        while b"\r\n\r\n" not in self.buffer:
            self._until(len(self.buffer) + 1)
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        size = int(headers["content-length"])
        self._until(size)
        body, self.buffer = self.buffer[:size], self.buffer[size:]
        return int(status_line.split()[1]), headers, json.loads(body)


def nothing_more(sock: socket.socket, replies: Replies) -> bytes:
    """Close our side and read to the end: what the door sent that no request asked for."""
    sock.shutdown(socket.SHUT_WR)
    extra = replies.buffer
    while data := sock.recv(65536):
        extra += data
    return extra


def test_one_keep_alive_connection_answers_each_generate_request_once(served):
    """Completions, chat, a 400 (too many stop strings), a tiny temperature, completions again: each
    answered once, in order, on one connection that stays open; nothing unrequested after them."""
    asks = [("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
            ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w1"}],
                                      "max_tokens": 2}),
            ("/v1/completions", {"model": "tiny", "prompt": "hi",
                                 "stop": [f"s{i}" for i in range(P.MAX_STOP_STRINGS + 1)]}),
            ("/v1/completions", {"model": "tiny", "prompt": "c d e f", "max_tokens": 4, "temperature": 1e-308}),
            ("/v1/completions", {"model": "tiny", "prompt": "c d e f", "max_tokens": 4})]
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
        replies, got = Replies(sock), []
        for n, (path, body) in enumerate(asks):
            sock.sendall(request(path, body, f"r{n}"))
            got.append(replies.next())
        assert nothing_more(sock, replies) == b""
    assert [status for status, _, _ in got] == [200, 200, 400, 200, 200], got
    assert [headers["x-request-id"] for _, headers, _ in got] == [f"r{n}" for n in range(len(asks))]
    assert all(headers.get("connection") != "close" for _, headers, _ in got)
    refused = got[2][2]["error"]
    assert refused["code"] == P.BAD_REQUEST and refused["message"].startswith('"stop" must be at most')
    assert got[3][2]["choices"][0]["text"] == got[4][2]["choices"][0]["text"]   # a tiny temperature is greedy
    log = served.log.read_text(errors="replace")
    assert "internal error" not in log and "failed: RuntimeError" not in log


def test_pipelined_generate_requests_are_answered_in_order(served):
    asks = [request("/v1/completions", {"model": "tiny", "prompt": "w1 w2", "max_tokens": 3}, f"p{n}")
            for n in range(3)]
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
        sock.sendall(b"".join(asks))
        replies = Replies(sock)
        got = [replies.next() for _ in asks]
        assert nothing_more(sock, replies) == b""
    assert [(status, headers["x-request-id"]) for status, headers, _ in got] == [(200, "p0"), (200, "p1"), (200, "p2")]
