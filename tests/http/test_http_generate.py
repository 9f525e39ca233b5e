"""Generative requests through the in-process door: `LocalDoor.stream` (chunks, then the one final
answer; closing early withdraws) and the HTTP door's OpenAI completions endpoints over a loopback
socket, against a fake daemon host that scripts the chunks. Fast and deterministic: every step
waits on an event the code under test sets, never on time."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from dynbatchd import protocol as P
from dynbatchd.doors import LocalDoor
from dynbatchd.engine import OK, Answer


class FakeHost:
    """A daemon host that records each request's envelope; a cancel settles it cancelled (as the
    daemon's generation path does once the worker ends the job)."""

    def __init__(self, state: str = "serving"):
        self.state = state
        self.config = SimpleNamespace(models={"gen": SimpleNamespace(runner="causal-lm", options={})},
                                      daemon=SimpleNamespace(keys_dir="", max_request_bytes=4096))
        self.requests: list[tuple] = []
        self.cancels: list = []
        self.arrived = asyncio.Event()

    def on_request(self, envelope, request, frames):
        if request.cancel:
            self.cancels.append(request.id)
            for env, req in self.requests:
                if env[0] == envelope[0] and req.id == request.id:
                    env.settle(Answer(None, P.CANCELLED, "cancelled after 1 tokens"))
            return
        self.requests.append((envelope, request))
        self.arrived.set()


def final(text: str | None = None, reason: str = "length", output_tokens: int = 2) -> Answer:
    value = {"finish_reason": reason, "output_tokens": output_tokens, "prompt_tokens": 3}
    if text is not None:
        value["text"] = text
    return Answer(None, OK, output=(value, None), timing=P.Timing(queue_us=1, compute_us=2, total_us=3))


def test_stream_yields_each_chunk_then_the_final_answer():
    async def run():
        host = FakeHost()
        stream = LocalDoor(host).stream(P.Request("r1", "gen", text="hi"))
        [(envelope, request)] = host.requests
        assert request.stream
        envelope.push(P.Chunk("r1", 0, "a", 1))
        envelope.push(P.Chunk("r1", 1, "b", 1))
        envelope.settle(final())
        items = [item async for item in stream]
        stream.close()   # after the end: nothing to withdraw
        return items, host.cancels

    items, cancels = asyncio.run(run())
    assert [i.text for i in items[:2]] == ["a", "b"] and items[2].code == OK
    assert items[2].output[0]["finish_reason"] == "length" and cancels == []


def test_closing_a_stream_early_withdraws_the_request_once():
    async def run():
        host = FakeHost()
        async with LocalDoor(host).stream(P.Request("r2", "gen", text="hi")) as stream:
            host.requests[0][0].push(P.Chunk("r2", 0, "a", 1))
            first = await stream.__anext__()
        stream.close()
        return first, host.cancels, stream.answer.result().code

    first, cancels, code = asyncio.run(run())
    assert first.text == "a" and cancels == ["r2"] and code == P.CANCELLED


def test_a_refused_stream_yields_only_its_final_answer():
    async def run():
        stream = LocalDoor(FakeHost(state="starting")).stream(P.Request("r3", "gen", text="hi"))
        return [item async for item in stream]

    [answer] = asyncio.run(run())
    assert answer.code == P.UNAVAILABLE


def test_infer_drops_chunks_and_gets_the_final_answer():
    async def run():
        host = FakeHost()
        future = LocalDoor(host).infer(P.Request("r4", "gen", text="hi"))
        host.requests[0][0].push(P.Chunk("r4", 0, "a", 1))   # ignored: not a stream
        host.requests[0][0].settle(final("ab"))
        return await future

    assert asyncio.run(run()).output[0]["text"] == "ab"
