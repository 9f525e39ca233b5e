"""The door's lines about one client's fault (a malformed request, a head or body too slow, a
hang-up) are budgeted per kind (`dynbatchd.logs.LineBudget`): a flood of bad requests wrote a line
each at info, the level the daemon runs at, enough to flood the journal, which past its rate limit
drops the daemon's lines wholesale. In this process, under uvloop as the daemon runs."""

from __future__ import annotations

import asyncio
import logging
import socket

import uvloop

from test_http_generate import FakeHost
from test_http_slow_readers import open_door

from dynbatchd.logs import LineBudget


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def malformed(port: int) -> bytes:
    """Send a request that is not HTTP; its answer, read to the close."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    return answer


def test_a_flood_of_malformed_requests_is_logged_within_the_budget_and_counted(caplog):
    clock = FakeClock()
    flood = LineBudget.BURST + 20

    async def main() -> list[bytes]:
        door = await open_door(FakeHost())
        door._lines = LineBudget(clock)
        loop = asyncio.get_running_loop()
        try:
            answers = [await loop.run_in_executor(None, malformed, door.port) for _ in range(flood)]
            clock.now += 1.0 / LineBudget.PER_SECOND
            answers.append(await loop.run_in_executor(None, malformed, door.port))
            return answers
        finally:
            await door.stop()

    with caplog.at_level(logging.INFO):
        answers = uvloop.run(main())
    assert all(answer.startswith(b"HTTP/1.1 400 ") for answer in answers)   # each still answered
    lines = [r.getMessage() for r in caplog.records if "malformed request: answered 400" in r.getMessage()]
    assert len(lines) == LineBudget.BURST + 1
    assert lines[-1].endswith("(and 20 more since the last such line)")
