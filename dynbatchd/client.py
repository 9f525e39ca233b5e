"""Clients for dynbatchd: `AsyncClient` (asyncio) and `Client` (blocking, thread-safe).

Both keep many requests in flight on one DEALER socket and match replies by
id. Errors arrive as exceptions, one class per protocol error code, all
subclasses of `DynbatchdError` with a `.code`.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterable

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from dynbatchd import protocol as P


class DynbatchdError(Exception):
    code = "error"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class BadRequest(DynbatchdError): code = P.BAD_REQUEST
class UnknownModel(DynbatchdError): code = P.UNKNOWN_MODEL
class Overloaded(DynbatchdError): code = P.OVERLOADED
class DeadlineExceeded(DynbatchdError): code = P.DEADLINE_EXCEEDED
class ModelError(DynbatchdError): code = P.MODEL_ERROR
class ShuttingDown(DynbatchdError): code = P.SHUTTING_DOWN
class Refused(DynbatchdError): code = P.REFUSED


ERRORS: dict[str, type[DynbatchdError]] = {c.code: c for c in (
    BadRequest, UnknownModel, Overloaded, DeadlineExceeded, ModelError, ShuttingDown, Refused)}


@dataclass(frozen=True)
class Result:
    """An answer: `output` (numpy array or plain value) and where the time went."""
    id: int | str
    output: Any
    timing: P.Timing


def build_request(req_id: int, model: str, inputs: Any, **meta: Any) -> list[Any]:
    """Header plus frames for one request; numpy arrays travel as a raw frame."""
    fields = {k: v for k, v in meta.items() if v is not None and v != ()}
    if "tags" in fields:
        fields["tags"] = list(fields["tags"])
    frames: list[Any] = []
    if isinstance(inputs, str):
        fields["text"] = inputs
    elif isinstance(inputs, np.ndarray):
        arr = np.ascontiguousarray(inputs)
        fields["tensor"] = P.TensorRef(str(arr.dtype), list(arr.shape), 0)
        frames.append(memoryview(arr).cast("B") if arr.size else b"")
    else:
        fields["value"] = inputs
    return [P.encoder.encode(P.Request(req_id, model, **fields)), *frames]


def parse_reply(frames: list[bytes]) -> tuple[P.Reply, Any]:
    reply = P.reply_decoder.decode(frames[0])
    if reply.tensor is not None:
        ref = reply.tensor
        data = frames[1 + ref.frame]
        return reply, np.frombuffer(data, dtype=ref.dtype).reshape(ref.shape)
    return reply, reply.value


def raise_for(reply: P.Reply) -> None:
    if not reply.ok:
        err = reply.error or P.ErrorInfo("error", "request failed")
        raise ERRORS.get(err.code, DynbatchdError)(err.message, err.code)


class AsyncClient:
    """``await AsyncClient(endpoint).infer("minilm", "text")`` -> numpy array."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5555", *, context: zmq.asyncio.Context | None = None):
        self.endpoint = endpoint
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._reader:
            self._reader.cancel()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(DynbatchdError("client closed"))
        self._sock.close(0)

    async def _read_replies(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                reply = P.reply_decoder.decode(frames[0])
            except Exception:
                continue
            fut = self._pending.pop(reply.id, None)
            if fut is not None and not fut.done():
                fut.set_result(frames)

    async def infer_result(self, model: str, inputs: Any, *, tags: Iterable[str] = (), request_type: str | None = None,
                           user_frequency: str | None = None, tokens: int | None = None, priority: int | None = None,
                           deadline_ms: float | None = None, tenant: str | None = None, user: str | None = None,
                           timeout: float | None = None) -> Result:
        """Like `infer`, but also returns the reply's timing."""
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read_replies())
        req_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        await self._sock.send_multipart(build_request(
            req_id, model, inputs, tags=tuple(tags), request_type=request_type, user_frequency=user_frequency,
            tokens=tokens, priority=priority, deadline_ms=deadline_ms, tenant=tenant, user=user))
        try:
            frames = await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(req_id, None)
        reply, output = parse_reply(frames)
        raise_for(reply)
        return Result(reply.id, output, reply.timing or P.Timing())

    async def infer(self, model: str, inputs: Any, **kwargs: Any) -> Any:
        """Send one input (text, numpy array or plain value) and return its output."""
        return (await self.infer_result(model, inputs, **kwargs)).output


class Client:
    """Blocking client; thread-safe, with many requests in flight (`submit` returns a Future)."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5555"):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dynbatchd-client", daemon=True)
        self._thread.start()
        self._async = self._call(self._make(endpoint))

    async def _make(self, endpoint: str) -> AsyncClient:
        return AsyncClient(endpoint, context=zmq.asyncio.Context())

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def submit(self, model: str, inputs: Any, **kwargs: Any) -> Future:
        """Start a request; the Future's result is a `Result` (output plus timing)."""
        return asyncio.run_coroutine_threadsafe(self._async.infer_result(model, inputs, **kwargs), self._loop)

    def infer_result(self, model: str, inputs: Any, **kwargs: Any) -> Result:
        return self.submit(model, inputs, **kwargs).result()

    def infer(self, model: str, inputs: Any, **kwargs: Any) -> Any:
        """Send one input and block for its output; raises a `DynbatchdError` subclass on error."""
        return self.infer_result(model, inputs, **kwargs).output

    def close(self) -> None:
        async def _close() -> None:
            self._async.close()
        self._call(_close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def control_call(endpoint: str, cmd: str, timeout_s: float = 5.0, **args: Any) -> Any:
    """One control-socket request; returns `result` or raises DynbatchdError with the daemon's message."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(P.encoder.encode({"cmd": cmd, "args": args}))
        if not sock.poll(int(timeout_s * 1000)):
            raise DynbatchdError(f"no answer from the daemon's control socket {endpoint} within {timeout_s:g} s "
                                 "(is dynbatchd running?)", "unreachable")
        reply = msgspec.msgpack.decode(sock.recv())
    finally:
        sock.close(0)
    if not reply.get("ok"):
        raise DynbatchdError(reply.get("error", "control command failed"), "control")
    return reply["result"]
