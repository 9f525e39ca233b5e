"""How an in-process front door (a ``dynbatchd_front_doors`` plugin, e.g. HTTP) reaches the daemon.

A request from a door takes the ZeroMQ request's path (`Daemon.on_request`); its answer settles a
future instead of going out on a socket.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from dynbatchd import protocol as P
from dynbatchd.daemonhost import DaemonHost
from dynbatchd.engine import Answer
from dynbatchd.transport import validate as validate_request


TEXT_FIELDS = ("model", "text", "user", "tenant", "request_type", "user_frequency")


def not_utf8(request: P.Request) -> str | None:
    """The first text field of `request` that cannot be encoded as UTF-8 (a lone surrogate), or None.
    The ZeroMQ decoder refuses such strings; one from a door would fail its batch's encoding and
    the top-users sketch's save."""
    for field in TEXT_FIELDS:
        value = getattr(request, field)
        if value is not None and not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                return field
    for tag in request.tags:
        if not tag.isascii():
            try:
                tag.encode()
            except UnicodeEncodeError:
                return "tags"
    return None


class LocalEnvelope(list):
    """Where the answer of a request from an in-process front door goes: a future, not a socket.
    Its one element stands for the client identity (unique per request), as a ZeroMQ envelope's.
    `tenant`: the tenant the door authenticated (an HTTP API key's), or None. `channels`: where
    that key may send (empty: anywhere), which the daemon's intake checks against the channel it
    routes to (`RequestMeta.allowed_channels`). `chunks`: a streamed request's queue
    (`LocalDoor.stream`), which gets each chunk and then the final answer; else None."""
    __slots__ = ("future", "tenant", "channels", "chunks")

    def __init__(self, identity: Any = (), tenant: str | None = None, channels: tuple[str, ...] = (),
                 chunks: asyncio.Queue | None = None):
        super().__init__(identity)
        self.future, self.tenant, self.channels, self.chunks = None, tenant, channels, chunks

    def push(self, chunk: P.Chunk) -> None:
        """A chunk of a streamed request's answer, before its final one (which comes through `settle`).
        Dropped for a request submitted with `LocalDoor.infer`: it waits for the final answer only."""
        if (chunks := self.chunks) is not None:
            chunks.put_nowait(chunk)

    def settle(self, answer: Answer) -> None:
        """Answer the future, and let go of it: the answer holds this envelope (its payload), so
        keeping the future would make a reference cycle per request, which only the collector's
        rare full passes free (the request path makes none: see dynbatchd/collector.py)."""
        future, self.future = self.future, None
        if future is not None and not future.done():
            future.set_result(answer)
            if (chunks := self.chunks) is not None:
                chunks.put_nowait(answer)


class LocalAnswer(asyncio.Future):
    """The future answer of one request from a front door, naming it for `LocalDoor.withdraw`."""
    identity: bytes
    request_id: Any


class LocalStream:
    """A streamed request's answer from `LocalDoor.stream`: ``async for`` yields each `P.Chunk` as the
    worker produces it, then the final `Answer` (its code, and on success the finish reason and token
    counts), then stops. `close` before the end withdraws the request (an HTTP client that hung up):
    the worker frees its KV room at the next token boundary, and its final answer is dropped."""

    def __init__(self, door: "LocalDoor", answer: LocalAnswer, queue: asyncio.Queue):
        self._door, self.answer, self._queue = door, answer, queue
        self.ended = False

    def __aiter__(self) -> "LocalStream":
        return self

    async def __anext__(self) -> P.Chunk | Answer:
        if self.ended:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, Answer):
            self.ended = True
        return item

    def close(self) -> None:
        """Withdraw the request unless its final answer came (idempotent)."""
        if not self.ended and not self.answer.done():
            self.ended = True
            self._door.withdraw(self.answer)
        self.ended = True

    async def __aenter__(self) -> "LocalStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()


class LocalDoor:
    """What a front-door plugin may use of the daemon (see ``dynbatchd_front_doors``)."""

    def __init__(self, daemon: DaemonHost):
        self._daemon = daemon
        self._seq = 0

    @property
    def state(self) -> str:
        return self._daemon.state

    @property
    def models(self) -> dict[str, Any]:
        return dict(self._daemon.config.models)

    @property
    def keys_dir(self) -> str:
        return self._daemon.config.daemon.keys_dir

    @property
    def max_request_bytes(self) -> int:
        return self._daemon.config.daemon.max_request_bytes

    def generative(self, model: str) -> bool:
        """Whether `model` generates text token by token (a causal-lm runner's): what the completion
        endpoints serve."""
        generation = getattr(self._daemon, "generation", None)
        if generation is not None:
            return generation.generative(model)
        spec = self._daemon.config.models.get(model)
        return spec is not None and spec.runner == "causal-lm"

    def retry_after(self, tenant: str | None) -> str:
        """Retry-After for a request of `tenant` answered quota_exceeded: whole seconds, at least 1."""
        return self._daemon.quotas.retry_after_header(tenant)

    def infer(self, request: P.Request, *, tenant: str | None = None, channels: tuple[str, ...] = ()) -> LocalAnswer:
        """Submit `request` as if it came in over ZeroMQ; the future gets its one answer. `tenant`:
        the tenant the door authenticated (it may then reach isolated channels as that tenant);
        `channels`: where the caller may send (empty: anywhere), else the intake refuses it
        (routed once, by the daemon's intake)."""
        return self._submit(request, tenant, channels, None)

    def stream(self, request: P.Request, *, tenant: str | None = None, channels: tuple[str, ...] = ()) -> LocalStream:
        """Submit `request` with ``stream`` set (a generative model's: see docs/generation.md); the
        `LocalStream` yields its chunks as they come, then its one final answer. Refused requests
        yield the final answer only. Same `tenant` and `channels` as `infer`."""
        queue: asyncio.Queue = asyncio.Queue()
        if not request.stream:
            request = msgspec.structs.replace(request, stream=True)
        future = self._submit(request, tenant, channels, queue)
        return LocalStream(self, future, queue)

    def _submit(self, request: P.Request, tenant: str | None, channels: tuple[str, ...],
                chunks: asyncio.Queue | None) -> LocalAnswer:
        self._seq += 1
        envelope = LocalEnvelope([b"local:%d" % self._seq], tenant, channels, chunks)
        envelope.future = future = LocalAnswer(loop=asyncio.get_running_loop())
        future.identity, future.request_id = envelope[0], request.id
        problem = validate_request(request, [])
        if problem is None and (field := not_utf8(request)):
            problem = f"{field} is not UTF-8 text (a lone surrogate)"
        if problem:
            envelope.settle(Answer(None, P.BAD_REQUEST, problem))
        elif self._daemon.state == "starting":   # the door opens before the models load (probes)
            envelope.settle(Answer(None, P.UNAVAILABLE, "daemon is starting: its models are still loading"))
        else:
            self._daemon.on_request(envelope, request, [])
        return future

    def withdraw(self, future: LocalAnswer) -> None:
        """Withdraw the request `future` answers, as a ZeroMQ client's cancel does: still queued, it
        is answered cancelled now; already on a device, it runs to its end, except a generative one,
        which the worker ends at the next token boundary, freeing its KV room. (A front door's request
        of many inputs is all or none: when one is refused, the others go.)"""
        self._daemon.on_request([future.identity], P.Request(future.request_id, cancel=True), [])
