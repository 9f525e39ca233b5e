"""Generative requests through the in-process door: `LocalDoor.stream` (chunks, then the one final
answer; closing early withdraws) and the HTTP door's OpenAI completions endpoints over a loopback
socket, against a fake daemon host that scripts the chunks. Fast and deterministic: every step
waits on an event the code under test sets, never on time."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dynbatchd import protocol as P
from dynbatchd.doors import LocalDoor
from dynbatchd.engine import OK, Answer


class FakeHost:
    """A daemon host that records each request's envelope; a cancel settles it cancelled (as the
    daemon's generation path does once the worker ends the job)."""

    def __init__(self, state: str = "serving"):
        self.state = state
        self.config = SimpleNamespace(models={"gen": SimpleNamespace(runner="causal-lm", options={}),
                                              "enc": SimpleNamespace(runner="callable", options={})},
                                      daemon=SimpleNamespace(keys_dir="", max_request_bytes=4096))
        self.requests: list[tuple] = []
        self.cancels: list = []
        self.arrived = asyncio.Event()

    def on_request(self, envelope, request, frames):
        if request.cancel:
            self.cancels.append(request.id)
            if (withdrawn := getattr(self, "withdrawn", None)) is not None:
                withdrawn.set()
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


# -- the HTTP door over a loopback socket, in this process ---------------------------------------
import h11  # noqa: E402
import msgspec  # noqa: E402

from dynbatchd_plugins.http_config import HttpSettings  # noqa: E402
from dynbatchd_plugins.http import HttpDoor  # noqa: E402


class Quotas:
    def retry_after_header(self, tenant):
        return "7"


async def open_door(host: FakeHost, keys: bool = False) -> HttpDoor:
    host.quotas = Quotas()
    door = HttpDoor(HttpSettings(listen="127.0.0.1:0", keys=keys), LocalDoor(host))
    await door.start()
    door.port = door._server.sockets[0].getsockname()[1]
    return door


async def post(door: HttpDoor, path: str, body, *, until_events: int | None = None, headers=()):
    """(status, headers, data) of a POST; with `until_events` the connection is closed after that
    many SSE events, and data is what came."""
    reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
    client = h11.Connection(h11.CLIENT)
    raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
    writer.write(client.send(h11.Request(method="POST", target=path, headers=[
        ("host", "x"), ("content-type", "application/json"), ("content-length", str(len(raw))), *headers])))
    writer.write(client.send(h11.Data(data=raw)) + client.send(h11.EndOfMessage()))
    status, headers, data = None, {}, b""
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            client.receive_data(await reader.read(65536))
        elif isinstance(event, h11.Response):
            status, headers = event.status_code, {k.decode(): v.decode() for k, v in event.headers}
        elif isinstance(event, h11.Data):
            data += event.data
            if until_events is not None and data.count(b"\n\n") >= until_events:
                break
        else:
            break
    writer.close()
    return status, headers, data


def sse(data: bytes) -> list:
    events = [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e]
    return [e.decode() if e == b"[DONE]" else msgspec.json.decode(e) for e in events]


def served(host: FakeHost, script, keys: bool = False) -> object:
    """Run `script(door)` against a door on `host`; the door stops after it."""
    async def run():
        door = await open_door(host, keys)
        try:
            return await script(door)
        finally:
            await door.stop()
    return asyncio.run(run())


def test_completion_whole_shape_and_options_reach_the_request():
    host = FakeHost()

    async def script(door):
        call = asyncio.ensure_future(post(door, "/v1/completions", {
            "model": "gen", "prompt": "Once", "max_tokens": 5, "temperature": 0, "stop": "\n", "seed": 1,
            "top_p": 1, "user": "u1"}))
        await host.arrived.wait()
        host.requests[0][0].settle(final(" upon", "stop", 1))
        return await call

    status, headers, data = served(host, script)
    body = msgspec.json.decode(data)
    [(_, request)] = host.requests
    assert status == 200 and headers["content-type"] == "application/json"
    assert request.text == "Once" and not request.stream and request.user == "u1"
    assert request.generate == {"max_new_tokens": 5, "temperature": 0, "stop": ["\n"], "seed": 1}
    assert body["object"] == "text_completion" and body["model"] == "gen" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": " upon", "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


def test_chat_stream_is_sse_chunks_then_finish_usage_and_done():
    host = FakeHost()

    async def script(door):
        call = asyncio.ensure_future(post(door, "/v1/chat/completions", {
            "model": "gen", "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}))
        await host.arrived.wait()
        envelope, request = host.requests[0]
        envelope.push(P.Chunk(request.id, 0, "Hel", 1))
        envelope.push(P.Chunk(request.id, 1, "lo", 1))
        envelope.settle(final())
        return await call

    status, headers, data = served(host, script)
    [(_, request)] = host.requests
    assert request.stream and request.text == "system: Be brief.\nuser: Hi\nassistant:"
    assert status == 200 and headers["content-type"] == "text/event-stream"
    events = sse(data)
    assert events[-1] == "[DONE]"
    first, second, last, counts = events[:-1]
    assert {e["object"] for e in events[:-1]} == {"chat.completion.chunk"}
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert second["choices"][0]["delta"] == {"content": "lo"} and second["choices"][0]["finish_reason"] is None
    assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["delta"] == {}
    assert counts["choices"] == [] and counts["usage"]["total_tokens"] == 5


def test_a_client_hanging_up_mid_stream_withdraws_the_request():
    host = FakeHost()
    withdrawn = asyncio.Event

    async def script(door):
        host.withdrawn = withdrawn()
        call = asyncio.ensure_future(post(door, "/v1/completions", {"model": "gen", "prompt": "x", "stream": True},
                                          until_events=1))
        await host.arrived.wait()
        host.requests[0][0].push(P.Chunk(host.requests[0][1].id, 0, "a", 1))
        status, _, data = await call   # it closed after the first event
        await host.withdrawn.wait()
        return status, data

    status, data = served(host, script)
    assert status == 200 and sse(data)[0]["choices"][0]["text"] == "a"
    assert host.cancels == [host.requests[0][1].id]


def test_an_error_after_the_stream_began_is_an_error_event_then_done():
    host = FakeHost()

    async def script(door):
        call = asyncio.ensure_future(post(door, "/v1/completions", {"model": "gen", "prompt": "x", "stream": True}))
        await host.arrived.wait()
        host.requests[0][0].push(P.Chunk(host.requests[0][1].id, 0, "a", 1))
        host.requests[0][0].settle(Answer(None, P.DEADLINE_EXCEEDED, "deadline passed after 1 tokens"))
        return await call

    status, _, data = served(host, script)
    events = sse(data)
    assert status == 200 and events[-1] == "[DONE]"
    assert events[1]["error"] == {"code": P.DEADLINE_EXCEEDED, "message": "deadline passed after 1 tokens",
                                  "status": 504}


def answered(code: str, message: str = "no"):
    def respond(envelope, request, frames):
        envelope.settle(Answer(None, code, message))
    return respond


@pytest.mark.parametrize("path, body, respond, status, code", [
    ("/v1/completions", {"model": "gen"}, None, 400, P.BAD_REQUEST),                       # no prompt
    ("/v1/completions", {"model": "gen", "prompt": "x", "top_p": 0.5}, None, 400, P.BAD_REQUEST),
    ("/v1/completions", {"model": "gen", "prompt": "x", "max_tokens": 0}, None, 400, P.BAD_REQUEST),
    ("/v1/chat/completions", {"model": "gen", "messages": [{"role": "bot", "content": "x"}]}, None, 400,
     P.BAD_REQUEST),
    ("/v1/completions", {"model": "gen", "prompt": "x", "stream": True}, answered(P.OVERLOADED), 429, P.OVERLOADED),
    ("/v1/completions", {"model": "gen", "prompt": "x"}, answered(P.QUOTA_EXCEEDED), 429, P.QUOTA_EXCEEDED),
    ("/v1/chat/completions", {"model": "gen", "messages": [{"role": "user", "content": "x"}]},
     answered(P.DEADLINE_EXCEEDED), 504, P.DEADLINE_EXCEEDED),
    ("/v1/completions", {"model": "gen", "prompt": "x" * 5000}, None, 413, P.BAD_REQUEST),  # over max_request_bytes
    ("/v1/completions", {"model": "enc", "prompt": "x"}, None, 400, P.BAD_REQUEST),     # not a causal-lm model
    ("/v1/completions", {"model": "nope", "prompt": "x"}, None, 404, P.UNKNOWN_MODEL),
])
def test_errors_are_openai_shaped_with_their_status(path, body, respond, status, code):
    host = FakeHost()
    if respond is not None:
        host.on_request = respond

    async def script(door):
        return await post(door, path, body)

    got, headers, data = served(host, script)
    assert got == status and msgspec.json.decode(data)["error"]["code"] == code
    if code == P.QUOTA_EXCEEDED:
        assert headers["retry-after"] == "7"


def test_a_starting_daemon_answers_503():
    async def script(door):
        return await post(door, "/v1/completions", {"model": "gen", "prompt": "x", "stream": True})

    status, headers, data = served(FakeHost(state="starting"), script)
    assert status == 503 and msgspec.json.decode(data)["error"]["code"] == P.UNAVAILABLE


def test_a_client_hanging_up_before_a_whole_answer_withdraws_the_request():
    host = FakeHost()

    async def script(door):
        host.withdrawn = asyncio.Event()
        reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
        raw = msgspec.json.encode({"model": "gen", "prompt": "x"})
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(raw), raw))
        await host.arrived.wait()
        writer.close()
        await host.withdrawn.wait()

    served(host, script)
    assert host.cancels == [host.requests[0][1].id]


def test_the_completion_routes_need_an_api_key_as_embeddings_do(tmp_path):
    from dynbatchd.httpkeys import create

    host = FakeHost()
    host.config.daemon.keys_dir = str(tmp_path)
    key = create(tmp_path, "alice", "bank-a")

    async def script(door):
        refused = await post(door, "/v1/chat/completions", {"model": "gen", "messages": []})
        call = asyncio.ensure_future(post(door, "/v1/completions", {"model": "gen", "prompt": "x"},
                                          headers=[("authorization", f"Bearer {key}")]))
        await host.arrived.wait()
        host.requests[0][0].settle(final("y"))
        return refused, await call

    refused, allowed = served(host, script, keys=True)
    assert refused[0] == 401 and msgspec.json.decode(refused[2])["error"]["code"] == "unauthorized"
    envelope, request = host.requests[0]
    assert allowed[0] == 200 and envelope.tenant == "bank-a" and request.tenant == "bank-a"


def test_a_stream_that_fails_before_its_first_token_gets_the_errors_status():
    host = FakeHost()

    async def script(door):
        call = asyncio.ensure_future(post(door, "/v1/completions", {"model": "gen", "prompt": "x", "stream": True}))
        await host.arrived.wait()
        host.requests[0][0].settle(Answer(None, P.DEADLINE_EXCEEDED, "deadline passed after 0 tokens"))
        return await call

    status, headers, data = served(host, script)
    assert status == 504 and headers["content-type"] == "application/json"
    assert msgspec.json.decode(data)["error"]["code"] == P.DEADLINE_EXCEEDED and "x-request-id" in headers
