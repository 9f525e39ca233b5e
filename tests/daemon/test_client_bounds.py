"""What a hostile "daemon" can make the client library hold: a ROUTER socket on a thread (`fakedaemon.Fake`)
answers each request with the frames a test scripts. A flood of chunks ends its stream in
`StreamOverflow` at `stream_buffer_bytes`, and frames for ids never sent are counted and dropped.
Every wait is bounded: a regression fails, it does not hang."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import pytest

from dynbatchd.asyncclient import AsyncClient
from dynbatchd.client import HANDOFF, BadRequest, Chunk, Client, StreamOverflow
from dynbatchd.clientwire import CHUNK_OVERHEAD

from fakedaemon import fake_daemons, frame, ok
from helpers import wait_until

BOUND_S = 20
CAP = 8192   # stream_buffer_bytes in these tests


def chunk(req_id: Any, n: int) -> list[bytes]:
    return [frame({"id": req_id, "chunk": n, "text": "x" * 100, "tokens": 1})]


@pytest.fixture
def hostile(tmp_path):
    """`hostile(respond)` starts a stand-in daemon (`fakedaemon.Fake`); all are closed after the test."""
    yield from fake_daemons(tmp_path)


def flood(bursts: int, per_burst: int) -> Callable[[dict], list[list[bytes]]]:
    """A stream gets chunk 0; each later request ("more") `per_burst` chunks more of it, then its own reply
    (after them on the wire: when that reply is read, so are they). Nothing ever ends the stream."""
    sent = {"stream": None, "n": 0}

    def respond(h: dict) -> list[list[bytes]]:
        if h.get("cancel"):
            return []
        if h.get("stream"):
            sent["stream"], sent["n"] = h["id"], 1
            return [chunk(h["id"], 0)]
        burst = [chunk(sent["stream"], sent["n"] + i) for i in range(per_burst)] if h["text"] == "more" else []
        sent["n"] += len(burst)
        return [*burst, ok(h["id"], h["text"])]
    return respond


def test_frames_for_ids_never_sent_are_counted_and_not_held(hostile):
    stranger = 10**12
    server = hostile(lambda h: [*(chunk(stranger, n) for n in range(300)), *(ok(stranger + n, "x") for n in range(300)),
                                ok(h["id"], h["text"])])
    with Client(server.endpoint, timeout=BOUND_S) as client:
        assert client.infer("m", "mine") == "mine"
        stats = client._async.statistics()
    assert stats["dropped_frames"] == 600 and stats["pending"] == stats["streams"] == stats["stream_bytes"] == 0


def test_an_async_stream_flooded_past_its_buffer_ends_in_stream_overflow_and_is_withdrawn(hostile):
    server = hostile(flood(1, 500))

    async def main() -> tuple[dict, list]:
        async with AsyncClient(server.endpoint, timeout=BOUND_S, stream_buffer_bytes=CAP) as client:
            stream = client.stream("m", "go")
            got = [await stream.__anext__()]
            assert await client.infer("m", "more") == "more"   # the 500 chunks before it are read too
            stats = client.statistics()
            with pytest.raises(StreamOverflow, match="stream_buffer_bytes"):
                async for item in stream:
                    got.append(item)
            return stats, got

    stats, got = asyncio.run(main())
    assert stats["overflowed_streams"] == 1 and stats["streams"] == 0 and stats["dropped_frames"] > 400
    assert all(isinstance(c, Chunk) for c in got) and (len(got) - 1) * (100 + CHUNK_OVERHEAD) <= CAP
    wait_until(lambda: {"id": 1, "cancel": True} in server.seen, BOUND_S, message="the daemon was not told to stop")


def test_a_blocking_stream_whose_reader_falls_behind_is_bounded_too(hostile):
    """The blocking client hands chunks to the caller's thread through a queue of its own: that queue
    must not soak up what the stream's bounded buffer would refuse (300 chunks, one a round trip,
    which that queue would take as they come; a caller that reads none of them until the end)."""
    server = hostile(flood(300, 1))
    with Client(server.endpoint, timeout=5, stream_buffer_bytes=CAP) as client:
        stream = client.stream("m", "go")
        got = [next(stream)]
        for _ in range(300):
            assert client.infer("m", "more") == "more"
        with pytest.raises(StreamOverflow):
            got.extend(stream)
    assert len(got) <= 1 + HANDOFF + CAP // (100 + CHUNK_OVERHEAD)   # not the 301 sent


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "1"])
def test_a_limit_that_is_no_positive_whole_number_is_bad_request(value):
    with pytest.raises(BadRequest, match="stream_buffer_bytes"):
        AsyncClient("ipc:///nonexistent/x.sock", stream_buffer_bytes=value)
