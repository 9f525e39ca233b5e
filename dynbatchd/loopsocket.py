"""A ZeroMQ socket on the asyncio event loop: `LoopSocket` drains an edge-triggered socket on
every wake-up and sends without blocking; `Message` carries a CURVE peer's key name and role;
`guard_connections` bounds how long a client's connection holds the daemon's resources.

Split out of `dynbatchd.transport` so the worker pool and the control socket can use the loop
plumbing without the request front end. Nothing here logs a message's content.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import zmq

from dynbatchd.logs import LineBudget

log = logging.getLogger("dynbatchd.transport")

DRAIN_LIMIT = 128  # messages read per loop turn: small enough that worker results are never kept waiting
# Frames of one message read and dropped per loop turn once it is past its socket's bounds (~0.5 us
# each): libzmq hands a message over only whole, so one of millions of empty frames (2 bytes each on
# the wire) took the loop for seconds and every frame's copy; dropped in slices, other work goes on.
SKIP_SLICE = 20_000
UNBOUNDED = 1 << 62
# Plain ints: pyzmq's flag enums cost an Enum construction per frame on the hot path.
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


ADMIN, CLIENT = "admin", "client"   # the roles of CURVE keys: keys_dir/admins/, keys_dir/clients/
ROLE_PROPERTY = "Role"              # the ZAP metadata property that carries a peer's role


class Message(list):
    """One multipart message's frames, and who sent it: the ZAP User-Id of a CURVE peer (the name
    of its key file), None where the socket authenticates no one; with `roles`, its role too
    (ADMIN or CLIENT; None without CURVE)."""
    __slots__ = ("user_id", "role")


class Oversized(Message):
    """A message past its socket's bounds (`LoopSocket` `max_frames`, `max_bytes`), cut short: its
    first frames (the envelope and the header at least), and how many frames (`count`) and bytes
    after the first frame (`size`) it had in all. The rest was read and dropped, never copied."""
    __slots__ = ("count", "size")


class LoopSocket:
    """A ZeroMQ socket driven by the event loop's reader callbacks.

    ZeroMQ's file descriptor is edge-triggered and is also consumed by sends,
    so the socket is drained until empty on every wake-up and re-checked
    after every send burst (`kick`). With `user_ids`, each message comes as a
    `Message` carrying its sender's authenticated identity (and with `roles`, its role).

    `drain_limit`: messages handled per loop turn. A message of more than `max_frames` frames, or
    of more than `max_bytes` bytes after its first frame, comes as an `Oversized` one, its excess
    dropped `SKIP_SLICE` frames a loop turn.
    """

    def __init__(self, sock: zmq.Socket, on_messages: Callable[[list[list[bytes]]], None], *,
                 user_ids: bool = False, roles: bool = False, drain_limit: int = DRAIN_LIMIT,
                 max_frames: int = UNBOUNDED, max_bytes: int = UNBOUNDED):
        self.sock = sock
        self.on_messages = on_messages   # called with every multipart message read in one pass
        self.user_ids = user_ids or roles
        self.roles = roles
        self.drain_limit, self.max_frames, self.max_bytes = drain_limit, max_frames, max_bytes
        self._cutting: Oversized | None = None   # an oversized message whose excess is being dropped
        self.undeliverable = 0           # replies ZeroMQ refused: peer gone, or its queue full
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kicked = False
        self._busy = False               # the last drain read more than one message

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

    def flush(self) -> None:
        """Hand on every message still queued, started or not: at shutdown, so that each one is
        answered (the daemon says ``shutting_down``) instead of dropped with the socket."""
        while True:
            batch = []
            try:
                while len(batch) < DRAIN_LIMIT:
                    batch.append(self._recv_message())
            except zmq.Again:
                pass
            if batch:
                try:
                    self.on_messages(batch)
                except Exception:
                    log.exception("internal error handling messages at close")
            if len(batch) < DRAIN_LIMIT:
                return

    def _drain(self) -> None:
        self._kicked = False
        if self._loop is None:
            return
        batch: list[list[bytes]] = []
        if self._cutting is not None:   # the excess of an oversized message, a slice a turn
            message = self._skip(SKIP_SLICE)
            if message is None:
                self.kick()
                return
            batch.append(message)
        recv, option, busy = self.sock.recv, self.sock.getsockopt, self._busy
        limit, max_frames, max_bytes = self.drain_limit, self.max_frames, self.max_bytes
        # Each call into ZeroMQ costs 2-8 us on a small VM, so a drain makes as few as it can. Frames
        # come uncopied to read `more` off each one (no RCVMORE per frame). An idle socket (one
        # message a wake-up, or none after a kick) asks EVENTS before each read (~3 us); a busy
        # one reads until zmq.Again (~8 us, once) instead of asking before every message.
        try:
            while len(batch) < limit and (busy or option(_EVENTS) & _POLLIN):
                if self.user_ids:
                    frames, frame = self._recv_with_user_id()
                else:
                    frame = recv(_NOBLOCK, copy=False)
                    frames = [frame.bytes]
                size = 0
                while frame.more:
                    if len(frames) >= max_frames or size > max_bytes:
                        frames = self._cut(frames, size, SKIP_SLICE)
                        break
                    frame = recv(_NOBLOCK, copy=False)
                    data = frame.bytes
                    size += len(data)
                    frames.append(data)
                if frames is None:   # its excess is still being dropped: the rest next turn
                    break
                batch.append(frames)
        except zmq.Again:
            pass
        self._busy = len(batch) > 1
        if batch:
            try:
                self.on_messages(batch)
            except Exception:   # a bug in a handler must not stop this socket being read
                log.exception("internal error handling messages on %s", self.sock.getsockopt(zmq.LAST_ENDPOINT))
        # The socket was read empty, so the next arrival signals its descriptor; only a send can
        # swallow that edge, and every send kicks (`send`, DevicePool.send): no EVENTS check here.
        if len(batch) >= limit or self._cutting is not None:
            self.kick()

    def _recv_message(self) -> list[bytes]:
        """One whole multipart message (zmq.Again if none is queued), bounded as `_drain` bounds
        it but dropping an oversized one's excess at once; `_drain` inlines this."""
        if self._cutting is not None:
            return self._skip(UNBOUNDED)
        if self.user_ids:
            frames, frame = self._recv_with_user_id()
        else:
            frame = self.sock.recv(_NOBLOCK, copy=False)
            frames = [frame.bytes]
        size = 0
        while frame.more:
            if len(frames) >= self.max_frames or size > self.max_bytes:
                return self._cut(frames, size, UNBOUNDED)
            frame = self.sock.recv(_NOBLOCK, copy=False)
            frames.append(frame.bytes)
            size += len(frames[-1])
        return frames

    def _cut(self, frames: list[bytes], size: int, most: int) -> Oversized | None:
        """Begin dropping the rest of a message past the bounds (its frames so far: `frames`, the
        last read with more to come); the message once its last frame is read, else None."""
        message = Oversized(frames)
        message.user_id = getattr(frames, "user_id", None)
        message.role = getattr(frames, "role", None)
        message.count, message.size = len(frames), size
        self._cutting = message
        return self._skip(most)

    def _skip(self, most: int) -> Oversized | None:
        """Read and drop up to `most` more frames of the message being cut, counting them; it,
        once its last frame is read, else None."""
        message, recv = self._cutting, self.sock.recv
        count, size, more = message.count, message.size, True
        while more and count - message.count < most:
            frame = recv(_NOBLOCK, copy=False)
            count += 1
            size += len(frame)
            more = frame.more
        message.count, message.size = count, size
        if more:
            return None
        self._cutting = None
        return message

    def _recv_with_user_id(self) -> tuple[Message, zmq.Frame]:
        first = self.sock.recv(_NOBLOCK, copy=False)
        message = Message([first.bytes])
        try:
            message.user_id = first.get("User-Id")
        except zmq.ZMQError:   # no metadata: nobody authenticated this peer
            message.user_id = None
        message.role = None
        if self.roles and message.user_id is not None:
            try:
                message.role = first.get(ROLE_PROPERTY)
            except zmq.ZMQError:   # a libzmq without ZAP metadata: no role, so no admin
                pass
        return message, first

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


# A connection that has not finished its ZMTP (and CURVE) handshake by then is closed: libzmq's
# default, 30 s, let idle TCP connections hold a descriptor each long enough to take them all.
HANDSHAKE_MS = 5_000
# Each peer is pinged this often; one that sends nothing back (not even the pong its libzmq answers
# by itself) for HEARTBEAT_TIMEOUT_MS after a ping is disconnected. Such a peer is gone (a host off
# the network) or reads nothing (its own queue full), and its connection held its descriptor and up
# to SNDHWM unread replies for as long as the daemon ran.
HEARTBEAT_MS = 10_000
HEARTBEAT_TIMEOUT_MS = 30_000


def guard_connections(sock: zmq.Socket) -> None:
    """Bound what a client's connection may hold of a listening socket (call before bind)."""
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


class _Throttle:
    """At most one log line per `interval_s` for one kind of event; the rest are counted into the next
    (a `LineBudget` of one line at once)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0):
        self.log = logger
        self._budget = LineBudget(burst=1, per_second=1.0 / interval_s)

    def warning(self, message: str, *args: Any) -> None:
        if (more := self._budget.admit("")) is not None:
            self.log.warning(message + "%s", *args, more)