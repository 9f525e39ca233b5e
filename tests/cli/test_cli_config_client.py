"""The Python clients: a default timeout, and no future left unresolved when the daemon goes away.

The "daemon" here is a ROUTER socket that takes requests and never answers:
the tests wait for it to have received a request (an event, not a sleep)
before closing the client.
"""

from __future__ import annotations

import asyncio
import inspect

import pytest
import zmq
import zmq.asyncio

from dynbatchd import client as clientmod
from dynbatchd.client import AsyncClient, Client, ClientClosed, DynbatchdError, Timeout


@pytest.fixture
def silent(tmp_path):
    """A ROUTER that receives and never replies: a daemon that went away mid-request."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/silent.sock"
    sock.bind(endpoint)
    yield endpoint, sock
    sock.close(0)
    ctx.term()


def received(sock: zmq.Socket, n: int = 1) -> None:
    for _ in range(n):
        assert sock.poll(10_000), "the request never reached the socket"
        sock.recv_multipart()


def test_the_default_timeout_is_documented_and_used(silent):
    endpoint, _ = silent
    assert clientmod.DEFAULT_TIMEOUT_S == 60.0
    for cls in (Client, AsyncClient):
        assert inspect.signature(cls).parameters["timeout"].default == clientmod.DEFAULT_TIMEOUT_S
        assert "60 s" in " ".join((cls.__doc__ or "").split()) or "= 60" in (cls.__doc__ or "")
    with Client(endpoint) as client:
        assert client._async.timeout == 60.0


def test_a_request_nobody_answers_raises_timeout(silent):
    endpoint, sock = silent
    with Client(endpoint, timeout=0.05) as client:
        with pytest.raises(Timeout) as info:
            client.infer("m", "x")
        assert isinstance(info.value, TimeoutError) and isinstance(info.value, DynbatchdError)
        with pytest.raises(TimeoutError):
            client.infer("m", "x", timeout=0.05)     # a call's own timeout


def test_close_resolves_every_pending_future(silent):
    endpoint, sock = silent
    client = Client(endpoint, timeout=None)          # explicitly: wait forever
    futures = [client.submit("m", f"text {i}") for i in range(3)]
    received(sock, 3)
    assert not any(f.done() for f in futures)
    client.close()
    for fut in futures:
        assert isinstance(fut.exception(timeout=10), ClientClosed)
    late = client.submit("m", "after close")
    assert isinstance(late.exception(timeout=0), ClientClosed)
    client.close()                                     # twice is harmless


def test_the_async_client_fails_pending_requests_on_close(silent):
    endpoint, sock = silent

    async def scenario():
        ctx = zmq.asyncio.Context()
        client = AsyncClient(endpoint, timeout=None, context=ctx)
        task = asyncio.ensure_future(client.infer("m", "x"))
        while not sock.poll(0):                        # let the request go out, without sleeping
            await asyncio.sleep(0)
        client.close()
        with pytest.raises(ClientClosed):
            await task
        with pytest.raises(ClientClosed):
            await client.infer("m", "again")
        ctx.term()

    asyncio.run(scenario())


def test_the_async_client_times_out(silent):
    endpoint, _ = silent

    async def scenario():
        ctx = zmq.asyncio.Context()
        client = AsyncClient(endpoint, timeout=0.05, context=ctx)
        with pytest.raises(Timeout):
            await client.infer("m", "x")
        assert client._pending == {}                   # nothing left behind
        client.close()
        ctx.term()

    asyncio.run(scenario())


def test_every_protocol_error_code_has_its_exception_class():
    from dynbatchd import protocol as P

    assert set(clientmod.ERRORS) == set(P.ERROR_CODES)
    assert all(issubclass(cls, DynbatchdError) and cls.code == code for code, cls in clientmod.ERRORS.items())
