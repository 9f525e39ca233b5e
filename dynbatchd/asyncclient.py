"""`AsyncClient`: many requests in flight on one DEALER socket, replies matched by id, on the
caller's asyncio loop. The blocking `Client` (`dynbatchd.client`) runs one on a thread of its own.

A generative model's request can be streamed (`AsyncClient.stream`): its `Chunk` frames (no `ok`
key, dynbatchd-protocol(7)) go to that request's queue as the reader meets them, then its final
reply, so the caller sees text as it is generated and the final answer last.

What a daemon sends cannot pile up in the client (a broken or hostile peer included): a stream's
unread chunks are bounded by `stream_buffer_bytes` (past it the stream ends in `StreamOverflow`), and
a frame for an id nothing waits on is counted in `statistics()` and dropped. One frame's size is the
daemon's to bound (ZeroMQ's MAXMSGSIZE would end the connection for good, not the frame).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, AsyncIterator, Callable, Iterable

import msgspec
import zmq
import zmq.asyncio

from dynbatchd import protocol as P
from dynbatchd.clientwire import (CHUNK_OVERHEAD, CLIENT_TIMEOUT, DEFAULT_STREAM_BUFFER_BYTES, DEFAULT_TIMEOUT_S, BadReply, BadRequest, ClientClosed, CurveKeys, DynbatchdError,
                                  Result, StreamOverflow, Timeout, build_request, byte_limit, parse_reply, raise_for,
                                  tag_tuple, timeout_seconds)

# Reads a reply the typed decoder refused, to find the request it names (any failure: the frame is ignored).
_loose_decoder = msgspec.msgpack.Decoder()

# How long closing the socket may wait to deliver a cancel just sent (a stream left, Ctrl-C).
CANCEL_LINGER_MS = 100


class _Stream:
    """A streamed request's frames not yet read, and the bytes its chunks hold (against `stream_buffer_bytes`)."""
    __slots__ = ("queue", "held")

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.held = 0


class AsyncClient:
    """``await AsyncClient(endpoint).infer("minilm", "text")`` -> numpy array.

    `timeout` (seconds, default ``DEFAULT_TIMEOUT_S`` = 60) bounds every
    request, from sending it to its answer, unless a call gives its own; a
    request that runs out raises `Timeout` (a `TimeoutError`). Only an
    explicit ``timeout=None`` waits forever. `close()` fails every request
    still in flight with `ClientClosed`: no call is left waiting on a daemon
    that went away. `curve`: this client's keys and the daemon's public key
    (`CurveKeys`), for a daemon with CURVE on (used on tcp:// only).
    `stream_buffer_bytes` (default 16 MiB): the most a stream's unread chunks hold, each its frame's
    bytes plus 128.
    """

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5555", *, timeout: float | None = DEFAULT_TIMEOUT_S,
                 context: zmq.asyncio.Context | None = None, curve: CurveKeys | None = None,
                 stream_buffer_bytes: int = DEFAULT_STREAM_BUFFER_BYTES):
        self.endpoint = endpoint
        self.timeout = timeout_seconds(timeout)
        self.stream_buffer_bytes = byte_limit("stream_buffer_bytes", stream_buffer_bytes)
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock = self._connect(endpoint, curve)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._streams: dict[int, _Stream] = {}   # a streamed request's chunks, then its final frames
        self.dropped = 0      # frames for no request in flight (never sent, finished, or not readable)
        self.overflowed = 0   # streams ended by StreamOverflow
        self._reader: asyncio.Task | None = None
        self.closed = False
        self._linger_ms = 0   # 100 once a cancel was sent: closing right after it must not drop it

    def _connect(self, endpoint: str, curve: CurveKeys | None) -> zmq.asyncio.Socket:
        """The DEALER socket, connected; an endpoint or key ZeroMQ refuses is `BadRequest` naming it
        (and leaves no socket open)."""
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                curve.apply(sock, endpoint)
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise BadRequest(f"cannot connect to {endpoint!r}: {exc} (an endpoint is tcp://HOST:PORT or "
                             "ipc://PATH; CURVE keys are 40 Z85 characters each)") from None
        return sock

    def _ensure_reader(self) -> None:
        """Start the task that reads replies, again if it ended (its socket failed under it) or runs
        on a loop that is gone (an earlier `asyncio.run`): else no reply is read and every request
        runs into its timeout."""
        reader = self._reader
        if reader is not None and not reader.done() and reader.get_loop() is asyncio.get_running_loop():
            return
        self._reader = asyncio.ensure_future(self._read_replies())

    def statistics(self) -> dict[str, int]:
        """What the client holds now, and what it refused to hold since it started."""
        return {"pending": len(self._pending), "streams": len(self._streams),
                "stream_bytes": sum(s.held for s in self._streams.values()), "dropped_frames": self.dropped,
                "overflowed_streams": self.overflowed}

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the socket; every request still waiting fails with `ClientClosed`."""
        if self.closed:
            return
        self.closed = True
        if self._reader:
            self._reader.cancel()
        self._fail_pending(lambda: ClientClosed("client closed"))
        self._sock.close(self._linger_ms)

    def _fail_pending(self, error: Callable[[], DynbatchdError]) -> None:
        """Fail every request in flight with an `error()` of its own: one instance shared by callers
        on many threads gathered each raise's traceback (and the frames it holds) on one object."""
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(error())
                fut.exception()   # retrieved: a request whose send never finished does not await it
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.queue.put_nowait(error())

    async def _read_replies(self) -> None:
        try:
            while True:
                frames = await self._sock.recv_multipart()
                try:
                    reply = P.reply_decoder.decode(frames[0])
                except Exception as exc:   # no `ok`: a chunk of a streamed request (or a frame to ignore)
                    self._chunk(frames[0], exc)
                    continue
                if (stream := self._streams.pop(reply.id, None)) is not None:
                    stream.queue.put_nowait(frames)
                    continue
                fut = self._pending.pop(reply.id, None)
                if fut is not None and not fut.done():
                    fut.set_result(frames)
                else:
                    self.dropped += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:   # the socket failed under us: nobody may keep waiting for it
            why = f"connection to {self.endpoint} failed: {exc}"
            self._fail_pending(lambda: DynbatchdError(why, "closed"))

    def _chunk(self, frame: bytes, not_a_reply: Exception) -> None:
        try:
            chunk = P.chunk_decoder.decode(frame)
        except Exception:
            self._unreadable(frame, not_a_reply)
            return
        if (stream := self._streams.get(chunk.id)) is None:
            self.dropped += 1   # a chunk for no stream in flight: counted, never held
            return
        cost = len(frame) + CHUNK_OVERHEAD
        if stream.held + cost > self.stream_buffer_bytes:
            del self._streams[chunk.id]   # later frames for it are dropped
            self.overflowed += 1
            stream.queue.put_nowait(StreamOverflow(
                f"stream {chunk.id!r} from {self.endpoint}: over {self.stream_buffer_bytes:,} bytes of chunks unread "
                "(stream_buffer_bytes); the stream is ended and the daemon told to stop"))
            self._cancel(chunk.id)
            return
        stream.held += cost
        stream.queue.put_nowait((cost, chunk))

    def _unreadable(self, frame: bytes, why: Exception) -> None:
        """A final reply (it has `ok`) this client cannot read fails the request it names at once
        with `BadReply`, rather than leaving it to its timeout (or for ever, with none)."""
        try:
            header = _loose_decoder.decode(frame)
        except Exception:
            return
        req_id = header.get("id") if isinstance(header, dict) and "ok" in header else None
        if not isinstance(req_id, (int, str)) or isinstance(req_id, bool):
            self.dropped += 1
            return
        exc = BadReply(f"unreadable reply from {self.endpoint} to request {req_id!r}: {why}")
        if (fut := self._pending.pop(req_id, None)) is not None and not fut.done():
            fut.set_exception(exc)
        if (stream := self._streams.pop(req_id, None)) is not None:
            stream.queue.put_nowait(exc)

    async def infer_result(self, model: str, inputs: Any, *, tags: Iterable[str] = (), request_type: str | None = None,
                           user_frequency: str | None = None, tokens: int | None = None, priority: int | None = None,
                           deadline_ms: float | None = None, tenant: str | None = None, user: str | None = None,
                           generate: dict[str, Any] | None = None, timeout: float | None = CLIENT_TIMEOUT) -> Result:
        """Like `infer`, but also returns the reply's timing.

        `generate`: a generative model's options for this request (max_new_tokens, temperature,
        top_k, seed, stop); its output is then {finish_reason, output_tokens, prompt_tokens, text}.
        `timeout`: seconds for this request, sending included (default: the
        client's, 60 s unless set; None: no limit). Raises `Timeout` past it.
        """
        if self.closed:
            raise ClientClosed("client closed")
        limit = self.timeout if timeout is CLIENT_TIMEOUT else timeout_seconds(timeout)
        req_id = next(self._ids)
        frames_out = build_request(   # before the id is pending: a request that cannot be sent leaves nothing behind
            req_id, model, inputs, tags=tag_tuple(tags), request_type=request_type, user_frequency=user_frequency,
            tokens=tokens, priority=priority, deadline_ms=deadline_ms, tenant=tenant, user=user, generate=generate)
        self._ensure_reader()
        fut = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut

        async def exchange() -> list[bytes]:
            if self.closed:   # closed before this task ran: a send on a closed socket leaves an orphan future
                raise ClientClosed("client closed")
            await self._sock.send_multipart(frames_out)
            return await fut

        try:
            frames = await asyncio.wait_for(exchange(), limit)
        except asyncio.TimeoutError:
            self._cancel(req_id)
            raise Timeout(f"no answer from {self.endpoint} within {limit:g} s") from None
        except asyncio.CancelledError:   # the caller gave up (a cancelled task or future)
            self._cancel(req_id)
            raise
        except zmq.ZMQError as exc:
            if self.closed:
                raise ClientClosed("client closed") from None
            raise DynbatchdError(f"cannot send to {self.endpoint}: {exc}", "closed") from None
        finally:
            self._pending.pop(req_id, None)
        reply, output = parse_reply(frames)
        raise_for(reply)
        return Result(reply.id, output, reply.timing or P.Timing())

    def _cancel(self, req_id: int) -> None:
        """Tell the daemon to withdraw `req_id` if it is still queued (best effort, never blocks)."""
        if self.closed:   # the socket is gone, and the daemon drops what a gone client asked
            return
        try:
            sent = self._sock.send(P.encoder.encode(P.Request(req_id, cancel=True)), zmq.NOBLOCK)
        except zmq.ZMQError:
            return
        self._linger_ms = CANCEL_LINGER_MS
        if isinstance(sent, asyncio.Future):   # its failure is retrieved here, never left to be logged
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def infer(self, model: str, inputs: Any, **kwargs: Any) -> Any:
        """Send one input (text, numpy array or plain value) and return its output."""
        return (await self.infer_result(model, inputs, **kwargs)).output

    async def stream(self, model: str, text: str, *, generate: dict[str, Any] | None = None,
                     tags: Iterable[str] = (), request_type: str | None = None, user_frequency: str | None = None,
                     tokens: int | None = None, priority: int | None = None, deadline_ms: float | None = None,
                     tenant: str | None = None, user: str | None = None,
                     timeout: float | None = CLIENT_TIMEOUT) -> AsyncIterator[P.Chunk | Result]:
        """Stream a generative model's answer: each `P.Chunk` (its new `text`) as it comes, then one
        `Result` whose output is {finish_reason, output_tokens, prompt_tokens}; an error ends it as
        a `DynbatchdError` (after the chunks already yielded). Leaving the loop early cancels the
        request (the daemon frees its KV at the next token). `timeout` bounds each wait for the
        next frame, not the whole stream: a long generation that keeps coming is not cut off,
        a daemon that went silent is (`Timeout`); the request's deadline bounds the whole.
        """
        if self.closed:
            raise ClientClosed("client closed")
        limit = self.timeout if timeout is CLIENT_TIMEOUT else timeout_seconds(timeout)
        req_id = next(self._ids)
        frames_out = build_request(
            req_id, model, text, tags=tag_tuple(tags), request_type=request_type, user_frequency=user_frequency,
            tokens=tokens, priority=priority, deadline_ms=deadline_ms, tenant=tenant, user=user, stream=True,
            generate=generate)
        self._ensure_reader()
        stream = self._streams[req_id] = _Stream()
        done = False
        try:
            try:
                await self._sock.send_multipart(frames_out)
            except zmq.ZMQError as exc:
                raise (ClientClosed("client closed") if self.closed else
                       DynbatchdError(f"cannot send to {self.endpoint}: {exc}", "closed")) from None
            while True:
                try:
                    item = await asyncio.wait_for(stream.queue.get(), limit)
                except asyncio.TimeoutError:
                    raise Timeout(f"nothing more of the stream from {self.endpoint} within {limit:g} s") from None
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if isinstance(item, tuple):   # (its cost, a chunk)
                    stream.held -= item[0]
                    yield item[1]
                    continue
                done = True
                reply, output = parse_reply(item)
                raise_for(reply)
                yield Result(reply.id, output, reply.timing or P.Timing())
                return
        finally:
            self._streams.pop(req_id, None)
            if not done:   # the caller left early, timed out or was cancelled: the daemon stops generating
                self._cancel(req_id)
