"""The control socket (ROUTER): one msgpack request -> one msgpack reply.

Request: ``{"cmd": NAME, "args": {...}}``. Reply: ``{"ok": true, "result": ...}``
or ``{"ok": false, "error": MESSAGE}``. Commands live in
`dynbatchd.control.commands`, one function each.

Whoever reaches this socket can retune and stop the daemon, so an ipc:// one
is a file of mode 0660 and the daemon's group (in the runtime directory, see
`dynbatchd.config.runtime_dir`; the per-user one is made mode 0700), and a
tcp:// one needs ``[daemon] curve`` on (the config refuses it otherwise, even
on loopback): then a client key may only read (`commands.OPEN_TO_CLIENTS`),
and what changes or stops the daemon needs an admin key (`commands.needs_admin`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from dynbatchd import config as cfgmod, protocol as P
from dynbatchd.control.commands import COMMANDS, TAKES_PEER, CommandError, for_client, needs_admin
from dynbatchd.transport import (ADMIN, CurveServer, LoopSocket, Oversized, _Throttle, bind, guard_connections,
                                 ipc_file_of, remove_ipc_file, split_envelope)

log = logging.getLogger(__name__)


class ControlRequest(msgspec.Struct):
    cmd: str
    args: dict[str, Any] = {}


_decoder = msgspec.msgpack.Decoder(ControlRequest)


SOCKET_MODE = 0o660   # an ipc:// control socket: the daemon's user and group only
# Commands handled per loop turn. A command may cost far more than a request (a status with 100,000
# tenants in the quota table: ~25 ms), and a drain of 128 of them held every client's request 3 s.
DRAIN_LIMIT = 4
MAX_FRAMES = 8        # a request is one frame (after the envelope); more than this is dropped unread
CLIENT_STATUS_NS = 1_000_000_000   # a client key's status may be this old: a flood of them costs one a second


class ControlServer:
    def __init__(self, ctx: zmq.Context, endpoint: str, daemon: Any, *, curve: CurveServer | None = None):
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 500)
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        guard_connections(sock)
        self.unauthenticated = 0   # handshakes refused by CURVE (tcp:// with curve on)
        self.curve = curve is not None and curve.secure(sock, endpoint, self._refused)
        try:
            if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):
                directory = Path(endpoint[len("ipc://"):]).parent
                if directory == cfgmod.private_runtime_dir():
                    cfgmod.ensure_private_dir(directory)
            bind(sock, endpoint, mode=SOCKET_MODE)
        except BaseException:
            sock.close(linger=0)
            raise
        self.endpoint = endpoint
        self.bound_file = ipc_file_of(endpoint)
        # No keys on ipc:// or inproc://: the file's permissions (or the process) already chose who
        # may come, as admins. A tcp:// one without CURVE (which the config refuses) admits no admin.
        self.keyless_admin = not endpoint.startswith("tcp://")
        self.daemon = daemon
        self.clock = time.monotonic_ns
        self.io = LoopSocket(sock, self._on_messages, roles=self.curve, drain_limit=DRAIN_LIMIT, max_frames=MAX_FRAMES,
                             max_bytes=1 << 20)
        self.refused_not_admin = 0   # commands refused to a client key
        self._client_status: tuple[int, Any] | None = None   # (when, result) of the last status a client key saw
        self._refusals = _Throttle(log)
        self._answering: set[asyncio.Task] = set()   # commands answered when done (the loop keeps only weak refs)

    def _refused(self) -> None:
        self.unauthenticated += 1

    def close(self, linger: int = 0) -> None:
        """Stop reading, close the socket and remove its ipc:// file."""
        self.io.stop()
        self.io.sock.close(linger=linger)
        remove_ipc_file(self.bound_file)

    def _on_messages(self, batch: list[list[bytes]]) -> None:
        for frames in batch:
            envelope, body = split_envelope(frames)
            if not body:
                continue
            if frames.__class__ is Oversized:   # its excess was dropped unread
                self._answer(envelope, {"ok": False, "error": f"a control request is one frame (a MessagePack map), "
                                                              f"not {frames.count - len(envelope)}"})
                continue
            if self.curve:
                who, admin = frames.user_id, frames.role == ADMIN
            else:
                who, admin = None, self.keyless_admin
            reply = self.handle(body[0], admin=admin, who=who)
            if inspect.isawaitable(reply):   # a command that waits (a risk assessment): answer when it is done
                task = asyncio.ensure_future(self._answer_later(envelope, reply))
                self._answering.add(task)
                task.add_done_callback(self._answering.discard)
            else:
                self._answer(envelope, reply)

    async def _answer_later(self, envelope: list[bytes], reply: Any) -> None:
        self._answer(envelope, await reply)

    def _answer(self, envelope: list[bytes], reply: dict[str, Any]) -> None:
        try:
            answer = P.encoder.encode(reply)
        except Exception as exc:   # e.g. a result that cannot be encoded: still one answer
            log.exception("control reply could not be encoded")
            answer = P.encoder.encode({"ok": False, "error": f"internal error: {type(exc).__name__}"})
        self.io.send([*envelope, answer])

    def handle(self, raw: bytes, *, admin: bool = True, who: str | None = None) -> Any:
        """One request's reply, or an awaitable of it; `admin`: the sender may change or stop the
        daemon (`who`: its key's name)."""
        try:
            request = P.decode_checked(_decoder, raw, "control request", "args")
        except P.MalformedMessage as exc:
            return {"ok": False, "error": str(exc)}
        command = COMMANDS.get(request.cmd)
        if command is None:
            return {"ok": False, "error": f"unknown command {request.cmd!r} (known: {', '.join(sorted(COMMANDS))})"}
        if not admin and needs_admin(request.cmd, request.args):
            self.refused_not_admin += 1
            self._refusals.warning("control: refused %s to CURVE key %r, a client's, not an admin's",
                                   request.cmd, who)
            return {"ok": False, "error": f"{request.cmd} needs an admin key: CURVE key {who!r} is a client's "
                                          "(keys_dir/clients/), and only keys in keys_dir/admins/ may change, "
                                          "stop or read the setup of the daemon"}
        if not admin and request.cmd == "status" and not request.args:
            return self._status_for_client()
        args = dict(request.args)
        if request.cmd in TAKES_PEER:   # who asks, for the log and the drop-in: never what the args claim
            args["by"] = who or "local"
        try:
            result = command(self.daemon, **args)
        except Exception as exc:
            return self._failed(request.cmd, exc)
        if inspect.isawaitable(result):
            return self._finish(request.cmd, result, admin)
        return {"ok": True, "result": result if admin else for_client(request.cmd, result)}

    def _status_for_client(self) -> dict[str, Any]:
        """`status` for a client key: computed at most once per CLIENT_STATUS_NS, so that a key that
        may only read cannot make the daemon compute it for every request of a flood."""
        now = self.clock()
        if self._client_status is None or now - self._client_status[0] >= CLIENT_STATUS_NS:
            try:
                result = COMMANDS["status"](self.daemon)
            except Exception as exc:
                return self._failed("status", exc)
            self._client_status = (now, {"ok": True, "result": for_client("status", result)})
        return self._client_status[1]

    async def _finish(self, cmd: str, pending: Any, admin: bool) -> dict[str, Any]:
        try:
            result = await pending
        except Exception as exc:
            return self._failed(cmd, exc)
        return {"ok": True, "result": result if admin else for_client(cmd, result)}

    @staticmethod
    def _failed(cmd: str, exc: Exception) -> dict[str, Any]:
        if isinstance(exc, CommandError):
            return {"ok": False, "error": str(exc)}
        if isinstance(exc, TypeError):
            return {"ok": False, "error": f"bad arguments for {cmd}: {exc}"}
        log.exception("control command %s failed", cmd, exc_info=exc)   # a control bug must not take the daemon down
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
