"""API keys on the OpenAI completions endpoints, in process: the same rule as /v1/embeddings (401
without a key, nothing submitted; a key's tenant becomes the request's, whole or streamed; a key
bound to channels is refused 403 elsewhere). Over a loopback socket, with the fake daemon host of
test_http_generate; every step waits on an event, never on time."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import h11
import msgspec
import pytest

from test_http_generate import FakeHost, Quotas, final, sse

from dynbatchd import httpkeys
from dynbatchd import protocol as P
from dynbatchd.config import ChannelSettings
from dynbatchd.engine import Answer
from dynbatchd.engine.intake import Intake, Refusal, RequestMeta, sim_config
from dynbatchd_plugins.http_config import HttpSettings
from dynbatchd.doors import LocalDoor
from dynbatchd_plugins.http import HttpDoor


def keyed_host(tmp_path, channel: str = "standard") -> FakeHost:
    """A fake host whose keys live in `tmp_path` and whose routing sends everything to `channel`."""
    host = FakeHost()
    host.config.daemon.keys_dir = str(tmp_path)
    host.quotas = Quotas()
    host.plugins = SimpleNamespace(channel_for=lambda info, config: channel)
    return host


async def ask(door: HttpDoor, path: str, body: dict, key: str | None) -> tuple[int, bytes]:
    """(status, body) of one POST with `key` as its bearer token (none when None)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
    client = h11.Connection(h11.CLIENT)
    raw = msgspec.json.encode(body)
    head = [("host", "x"), ("content-type", "application/json"), ("content-length", str(len(raw)))]
    if key is not None:
        head.append(("authorization", f"Bearer {key}"))
    writer.write(client.send(h11.Request(method="POST", target=path, headers=head)) + client.send(h11.Data(data=raw))
                 + client.send(h11.EndOfMessage()))
    status, data = None, b""
    while not isinstance(event := client.next_event(), (h11.EndOfMessage, h11.ConnectionClosed)):
        if event is h11.NEED_DATA:
            client.receive_data(await reader.read(65536))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            data += event.data
    writer.close()
    return status, data


def serve(host: FakeHost, script):
    async def run():
        door = HttpDoor(HttpSettings(listen="127.0.0.1:0", keys=True), LocalDoor(host))
        await door.start()
        door.port = door._server.sockets[0].getsockname()[1]
        try:
            return await script(door)
        finally:
            await door.stop()
    return asyncio.run(run())


CHAT = {"model": "gen", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.mark.parametrize("path, body", [("/v1/completions", {"model": "gen", "prompt": "x"}),
                                        ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("key", [None, "dbk_alice_wrong", "not-a-key"])
def test_without_a_valid_key_it_is_401_and_nothing_is_submitted(tmp_path, path, body, key):
    httpkeys.create(tmp_path, "alice", "bank-a")
    host = keyed_host(tmp_path)
    status, data = serve(host, lambda door: ask(door, path, body, key))
    assert status == 401 and msgspec.json.decode(data)["error"]["code"] == "unauthorized"
    assert host.requests == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_keys_tenant_is_the_requests_whole_or_streamed(tmp_path, stream):
    key = httpkeys.create(tmp_path, "alice", "bank-a", ["standard"])
    host = keyed_host(tmp_path)

    async def script(door):
        call = asyncio.ensure_future(ask(door, "/v1/completions", {"model": "gen", "prompt": "x", "stream": stream},
                                         key))
        await host.arrived.wait()
        envelope, request = host.requests[0]
        if stream:
            envelope.push(P.Chunk(request.id, 0, "a", 1))
        envelope.settle(final(None if stream else "a"))
        return await call

    status, data = serve(host, script)
    [(envelope, request)] = host.requests
    assert status == 200 and request.tenant == "bank-a" and envelope.tenant == "bank-a"
    if stream:
        events = sse(data)
        assert events[0]["choices"][0]["text"] == "a" and events[-1] == "[DONE]"
    else:
        assert msgspec.json.decode(data)["choices"][0]["text"] == "a"


class IntakeHost(FakeHost):
    """A fake host that admits each request through a real intake (routing everything to
    "standard"), as the daemon's on_request does, and settles its refusal."""

    def on_request(self, envelope, request, frames):
        intake = Intake(sim_config({"standard": ChannelSettings(max_batch=1, window_ms=0, deadline_ms=1000)}),
                        lambda info, config: "standard")
        admitted = intake.admit(RequestMeta(request.model, tenant=request.tenant, key_tenant=envelope.tenant,
                                            allowed_channels=envelope.channels))
        if isinstance(admitted, Refusal):
            self.refusals.append(admitted)
            envelope.settle(Answer(None, admitted.code, admitted.message))
        else:
            super().on_request(envelope, request, frames)


def test_a_key_bound_to_other_channels_is_refused_403_before_the_stream(tmp_path):
    """The door hands the key's channels to the daemon, whose intake routes once and refuses."""
    key = httpkeys.create(tmp_path, "alice", "bank-a", ["vault"])
    host = IntakeHost()
    host.config.daemon.keys_dir, host.quotas, host.refusals = str(tmp_path), Quotas(), []
    status, data = serve(host, lambda door: ask(door, "/v1/chat/completions", CHAT, key))
    assert status == 403 and msgspec.json.decode(data)["error"]["code"] == P.REFUSED
    assert [(r.code, r.channel, r.message) for r in host.refusals] == [
        (P.REFUSED, "standard", "this API key may not send to channel 'standard'")]
    assert host.requests == []   # no generation started
