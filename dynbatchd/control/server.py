"""The control socket (ROUTER): one msgpack request -> one msgpack reply.

Request: ``{"cmd": NAME, "args": {...}}``. Reply: ``{"ok": true, "result": ...}``
or ``{"ok": false, "error": MESSAGE}``. Commands live in
`dynbatchd.control.commands`, one function each.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import zmq

from dynbatchd import protocol as P
from dynbatchd.control.commands import COMMANDS, CommandError
from dynbatchd.transport import LoopSocket, split_envelope

log = logging.getLogger(__name__)


class ControlRequest(msgspec.Struct):
    cmd: str
    args: dict[str, Any] = {}


_decoder = msgspec.msgpack.Decoder(ControlRequest)


class ControlServer:
    def __init__(self, ctx: zmq.Context, endpoint: str, daemon: Any):
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 500)
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        sock.bind(endpoint)
        self.daemon = daemon
        self.io = LoopSocket(sock, self._on_messages)

    def _on_messages(self, batch: list[list[bytes]]) -> None:
        for frames in batch:
            envelope, body = split_envelope(frames)
            if not body:
                continue
            try:
                answer = P.encoder.encode(self.handle(body[0]))
            except Exception as exc:   # e.g. a result that cannot be encoded: still one answer
                log.exception("control reply could not be encoded")
                answer = P.encoder.encode({"ok": False, "error": f"internal error: {type(exc).__name__}"})
            self.io.send([*envelope, answer])

    def handle(self, raw: bytes) -> dict[str, Any]:
        try:
            request = P.decode_checked(_decoder, raw, "control request", "args")
        except P.MalformedMessage as exc:
            return {"ok": False, "error": str(exc)}
        command = COMMANDS.get(request.cmd)
        if command is None:
            return {"ok": False, "error": f"unknown command {request.cmd!r} (known: {', '.join(sorted(COMMANDS))})"}
        try:
            return {"ok": True, "result": command(self.daemon, **request.args)}
        except CommandError as exc:
            return {"ok": False, "error": str(exc)}
        except TypeError as exc:
            return {"ok": False, "error": f"bad arguments for {request.cmd}: {exc}"}
        except Exception as exc:  # a control bug must not take the daemon down
            log.exception("control command %s failed", request.cmd)
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
