"""ZeroMQ on the event loop: the request front end (`FrontEnd`) and its frame validation.

Knows messages, not batching: it decodes and validates frames into protocol structs and hands
them on, and it sends replies back by ZeroMQ identity. A malformed message is answered with
``bad_request`` here and goes no further. Nothing here logs a request's content: a log line
names sizes, codes and endpoints only.

The loop plumbing lives in `dynbatchd.loopsocket`, CURVE in `dynbatchd.curve`, ipc:// files in
`dynbatchd.ipcfiles`; their names are re-exported here, where callers have always imported them.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import zmq

from dynbatchd import config as cfgmod, protocol as P
from dynbatchd.curve import CurveServer, _Authenticator  # noqa: F401  (re-exported)
from dynbatchd.ipcfiles import _ipc_in_use, _ipc_path, bind, ipc_file_of, remove_ipc_file  # noqa: F401
from dynbatchd.loopsocket import (ADMIN, CLIENT, DRAIN_LIMIT, ROLE_PROPERTY, LoopSocket, Message,  # noqa: F401
                                  Oversized, _Throttle, guard_connections)

log = logging.getLogger(__name__)


def split_envelope(frames: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """ROUTER frames -> (envelope, body). REQ clients put an empty delimiter after their identity."""
    if len(frames) >= 2 and frames[1] == b"":
        return frames[:2], frames[2:]
    return frames[:1], frames[1:]


MAX_DEADLINE_MS = cfgmod.MAX_MS   # one day: the config's bound on every duration
# A request is its header and the raw frames it references (one tensor: one frame). Empty frames cost
# 2 bytes on the wire each and nothing against max_request_bytes, but ~100 bytes and ~1 us each here.
MAX_REQUEST_FRAMES = 64
RequestHandler = Callable[[list[bytes], P.Request, list[bytes]], None]


class FrontEnd:
    """The request socket (ROUTER): decode, validate, hand on; encode and route replies."""

    clock: Callable[[], int] = staticmethod(time.monotonic_ns)
    # When the messages being handled were read (by `clock`): each one's arrival. A drain's messages
    # are handled one after another, ~50 us each, ~6 ms for a full drain (DRAIN_LIMIT), and the
    # last was waiting all along: stamped as its turn came, that wait fell outside every timing.
    read_ns = 0

    def __init__(self, ctx: zmq.Context, endpoint: str, max_request_bytes: int, handler: RequestHandler, *,
                 curve: CurveServer | None = None, clock: Callable[[], int] = time.monotonic_ns):
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a reply to a client that left is counted, not lost unseen
        # Hard stop far above the policy limit; the policy limit gets a polite reply.
        sock.setsockopt(zmq.MAXMSGSIZE, max(max_request_bytes * 4, 1 << 20))
        guard_connections(sock)
        self.unauthenticated = 0   # handshakes refused by CURVE (tcp:// with curve on): no data either way
        self.curve = curve is not None and curve.secure(sock, endpoint, self._refused)
        try:
            bind(sock, endpoint)
        except BaseException:
            sock.close(linger=0)
            raise
        self.endpoint = endpoint
        self.bound_file = ipc_file_of(endpoint)
        self.max_request_bytes = max_request_bytes
        self.handler = handler
        # (identity, a REQ client's empty delimiter, the request's frames; bytes after the identity)
        self.io = LoopSocket(sock, self._on_messages, user_ids=self.curve, max_frames=MAX_REQUEST_FRAMES + 2,
                             max_bytes=max_request_bytes)
        self.peer: str | None = None   # the message being handled: its sender's CURVE key name, if any
        self.clock = clock
        self.dropped = 0      # messages with no body to answer
        self.bad_requests = 0

    def _refused(self) -> None:
        self.unauthenticated += 1

    def close(self, linger: int = 0) -> None:
        """Stop reading, close the socket (replies sent still go out for `linger` ms) and remove
        its ipc:// file. What is still queued is dropped: `io.flush()` first answers it."""
        self.io.stop()
        self.io.sock.close(linger=linger)
        remove_ipc_file(self.bound_file)

    def _on_messages(self, batch: list[list[bytes]]) -> None:
        curve = self.curve   # (then each message is a Message carrying its sender's key name)
        self.read_ns = self.clock()
        for frames in batch:
            self.peer = frames.user_id if curve else None
            envelope, body = split_envelope(frames)
            if not body:
                self.dropped += 1
                continue
            try:
                if frames.__class__ is Oversized:   # its excess was dropped unread: only its size is answered
                    self._too_large(envelope, body, frames.count - len(envelope), frames.size)
                    continue
                self._on_request(envelope, body)
            except Exception:  # a bug must cost one message its answer's content, never the others theirs
                log.exception("internal error handling a request")
                self.reject(envelope, P.guess_id(body[0]), P.MODEL_ERROR, "internal error in the daemon; see its log")

    def _too_large(self, envelope: list[bytes], body: list[bytes], count: int, size: int) -> None:
        if size > self.max_request_bytes:
            why = f"request of {size} bytes exceeds max_request_bytes ({self.max_request_bytes})"
        else:
            why = f"request of {count} frames: at most {MAX_REQUEST_FRAMES} (a header and the raw frames it references)"
        self.reject(envelope, P.guess_id(body[0]), P.BAD_REQUEST, why)

    def _on_request(self, envelope: list[bytes], body: list[bytes]) -> None:
        size = sum(map(len, body))
        if size > self.max_request_bytes or len(body) > MAX_REQUEST_FRAMES:
            self._too_large(envelope, body, len(body), size)
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
    if request.cancel:
        return None   # only the id matters
    if not request.model:
        return "a request needs a model"
    given = (request.text is not None) + (request.tensor is not None) + (request.value is not None)
    if given != 1:
        return "a request needs exactly one input: text, tensor or value"
    if request.text is not None and (not request.text or request.text.isspace()):   # (no stripped copy made)
        return "text is empty (or only whitespace): there is nothing to run"
    if request.tenant is not None and len(request.tenant) > P.MAX_TENANT_CHARS:   # kept per tenant: a name
        return f"tenant must be at most {P.MAX_TENANT_CHARS} characters, got {len(request.tenant)}"
    if request.tokens is not None and request.tokens < 0:
        return "tokens must be >= 0"
    if request.deadline_ms is not None and not 0 < request.deadline_ms <= MAX_DEADLINE_MS:
        return f"deadline_ms must be > 0 and <= {MAX_DEADLINE_MS:g} (one day)"
    if request.generate is not None and (problem := P.check_generate(request.generate)):
        return problem
    if request.tensor is not None:
        return P.check_tensor(request.tensor, [len(f) for f in frames])
    return None
