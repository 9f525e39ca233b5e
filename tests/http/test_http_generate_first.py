"""A streamed completion's status waits for its first token: an error before it (the worker's
too-large prompt, a deadline, a model error) is answered with its own status and an OpenAI error
body, as a whole request's would be, not 200 and an error event; a client that hangs up before
the first token withdraws the request (its handler is cancelled while it waits). In process, with
the fake daemon host of test_http_generate; every step waits on an event, never on time."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from test_http_generate import FakeHost, final, post, served, sse

from dynbatchd import protocol as P
from dynbatchd.engine import Answer

BODY = {"model": "gen", "prompt": "x", "stream": True}


@pytest.mark.parametrize("code, message, status", [
    (P.BAD_REQUEST, "prompt (9 tokens) + max_new_tokens (5000) can never fit the KV budget of 400 tokens", 400),
    (P.DEADLINE_EXCEEDED, "deadline passed after 0 tokens", 504),
    (P.MODEL_ERROR, "the model's worker stopped mid-generation", 500),
])
def test_an_error_before_the_first_token_is_its_own_status(code, message, status):
    host = FakeHost()

    async def script(door):
        call = asyncio.ensure_future(post(door, "/v1/completions", BODY))
        await host.arrived.wait()
        host.requests[0][0].settle(Answer(None, code, message))
        return await call

    got, headers, data = served(host, script)
    assert got == status and headers["content-type"] == "application/json"
    assert msgspec.json.decode(data) == {"error": {"code": code, "message": message}}


def test_a_stream_that_ends_before_any_chunk_still_has_its_finish_and_done():
    host = FakeHost()

    async def script(door):
        call = asyncio.ensure_future(post(door, "/v1/completions", BODY))
        await host.arrived.wait()
        host.requests[0][0].settle(final(reason="stop", output_tokens=0))
        return await call

    status, _, data = served(host, script)
    finish, done = sse(data)
    assert status == 200 and finish["choices"][0]["finish_reason"] == "stop" and done == "[DONE]"


def test_a_client_hanging_up_before_the_first_token_withdraws_the_request():
    host = FakeHost()

    async def script(door):
        host.withdrawn = asyncio.Event()
        reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
        raw = msgspec.json.encode(BODY)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(raw), raw))
        await host.arrived.wait()
        writer.close()
        await host.withdrawn.wait()
        return host.cancels

    cancels = served(host, script)
    assert cancels == [host.requests[0][1].id]
