"""ZeroMQ on the event loop: the request front end and the control socket.

Knows messages, not batching: it decodes and validates frames into protocol
structs and hands them on, and it sends replies back by ZeroMQ identity. A
malformed message is answered with ``bad_request`` here and goes no further.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import zmq

from dynbatchd import protocol as P

log = logging.getLogger(__name__)

DRAIN_LIMIT = 128  # messages read per loop turn: small enough that worker results are never kept waiting
# Plain ints: pyzmq's flag enums cost an Enum construction per frame on the hot path.
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


class LoopSocket:
    """A ZeroMQ socket driven by the event loop's reader callbacks.

    ZeroMQ's file descriptor is edge-triggered and is also consumed by sends,
    so the socket is drained until empty on every wake-up and re-checked
    after every send burst (`kick`).
    """

    def __init__(self, sock: zmq.Socket, on_messages: Callable[[list[list[bytes]]], None]):
        self.sock = sock
        self.on_messages = on_messages   # called with every multipart message read in one pass
        self.undeliverable = 0           # replies ZeroMQ refused: peer gone, or its queue full
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kicked = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self.sock.getsockopt(zmq.FD), self._drain)
        loop.call_soon(self._drain)

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.sock.getsockopt(zmq.FD))
            self._loop = None

    def drain_now(self) -> None:
        """Handle whatever is already queued on the socket, now."""
        self._drain()

    def _drain(self) -> None:
        self._kicked = False
        if self._loop is None:
            return
        batch = []
        recv, more = self.sock.recv, self.sock.getsockopt
        try:
            while len(batch) < DRAIN_LIMIT:
                frames = [recv(_NOBLOCK)]
                while more(_RCVMORE):
                    frames.append(recv(_NOBLOCK))
                batch.append(frames)
        except zmq.Again:
            pass
        if batch:
            try:
                self.on_messages(batch)
            except Exception:   # a bug in a handler must not stop this socket being read
                log.exception("internal error handling messages on %s", self.sock.getsockopt(zmq.LAST_ENDPOINT))
        if len(batch) >= DRAIN_LIMIT:
            self.kick()
        elif self.sock.getsockopt(_EVENTS) & _POLLIN:
            self.kick()

    def kick(self) -> None:
        """Look for messages again soon: a send may have swallowed the readable edge."""
        if not self._kicked and self._loop is not None:
            self._kicked = True
            self._loop.call_soon(self._drain)

    def send(self, frames: list[Any]) -> bool:
        """Send one multipart message without blocking; False (and counted) when ZeroMQ refuses
        it: on a ROUTER_MANDATORY socket, a peer that left or whose queue is full."""
        send = self.sock.send
        try:
            for frame in frames[:-1]:
                send(frame, _MORE)
            send(frames[-1], _NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            self.undeliverable += 1
            log.debug("reply not delivered: %s", exc.strerror)
            return False
        finally:
            self.kick()


def split_envelope(frames: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """ROUTER frames -> (envelope, body). REQ clients put an empty delimiter after their identity."""
    if len(frames) >= 2 and frames[1] == b"":
        return frames[:2], frames[2:]
    return frames[:1], frames[1:]


MAX_DEADLINE_MS = 86_400_000.0
RequestHandler = Callable[[list[bytes], P.Request, list[bytes]], None]


class FrontEnd:
    """The request socket (ROUTER): decode, validate, hand on; encode and route replies."""

    def __init__(self, ctx: zmq.Context, endpoint: str, max_request_bytes: int, handler: RequestHandler):
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a reply to a client that left is counted, not lost unseen
        # Hard stop far above the policy limit; the policy limit gets a polite reply.
        sock.setsockopt(zmq.MAXMSGSIZE, max(max_request_bytes * 4, 1 << 20))
        sock.bind(endpoint)
        self.endpoint = endpoint
        self.max_request_bytes = max_request_bytes
        self.handler = handler
        self.io = LoopSocket(sock, self._on_messages)
        self.dropped = 0      # messages with no body to answer
        self.bad_requests = 0

    def _on_messages(self, batch: list[list[bytes]]) -> None:
        for frames in batch:
            envelope, body = split_envelope(frames)
            if not body:
                self.dropped += 1
                continue
            try:
                self._on_request(envelope, body)
            except Exception:  # a bug must cost one message its answer's content, never the others theirs
                log.exception("internal error handling a request")
                self.reject(envelope, P.guess_id(body[0]), P.MODEL_ERROR, "internal error in the daemon; see its log")

    def _on_request(self, envelope: list[bytes], body: list[bytes]) -> None:
        size = sum(map(len, body))
        if size > self.max_request_bytes:
            self.reject(envelope, P.guess_id(body[0]), P.BAD_REQUEST,
                        f"request of {size} bytes exceeds max_request_bytes ({self.max_request_bytes})")
            return
        try:
            request = P.decode_request(body[0])
        except P.MalformedMessage as exc:
            self.reject(envelope, P.guess_id(body[0]), P.BAD_REQUEST, str(exc))
            return
        problem = validate(request, body[1:])
        if problem:
            self.reject(envelope, request.id, P.BAD_REQUEST, problem)
            return
        self.handler(envelope, request, body[1:])

    def reject(self, envelope: list[bytes], req_id: Any, code: str, message: str) -> None:
        if code == P.BAD_REQUEST:
            self.bad_requests += 1
        self.reply(envelope, P.Reply(req_id, False, error=P.ErrorInfo(code, message)))

    def reply(self, envelope: list[bytes], reply: P.Reply, frames: tuple = ()) -> None:
        self.io.send([*envelope, P.encoder.encode(reply), *frames])


def validate(request: P.Request, frames: list[bytes]) -> str | None:
    """Why `request` cannot be served, or None. Checks shape only; the model checks content."""
    if request.v != P.PROTOCOL_VERSION:
        return f"protocol version {request.v} is not supported (this daemon speaks {P.PROTOCOL_VERSION})"
    given = (request.text is not None) + (request.tensor is not None) + (request.value is not None)
    if given != 1:
        return "a request needs exactly one input: text, tensor or value"
    if request.tokens is not None and request.tokens < 0:
        return "tokens must be >= 0"
    if request.deadline_ms is not None and not 0 < request.deadline_ms <= MAX_DEADLINE_MS:
        return f"deadline_ms must be > 0 and <= {MAX_DEADLINE_MS:g} (one day)"
    if request.tensor is not None:
        return P.check_tensor(request.tensor, [len(f) for f in frames])
    return None
