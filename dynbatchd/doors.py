"""How an in-process front door (a ``dynbatchd_front_doors`` plugin, e.g. HTTP) reaches the daemon.

A request from a door takes the ZeroMQ request's path (`Daemon.on_request`); its answer settles a
future instead of going out on a socket.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from dynbatchd import protocol as P
from dynbatchd.engine import Answer
from dynbatchd.transport import validate as validate_request

if TYPE_CHECKING:
    from dynbatchd.service import Daemon


class LocalEnvelope(list):
    """Where the answer of a request from an in-process front door goes: a future, not a socket.
    Its one element stands for the client identity (unique per request), as a ZeroMQ envelope's."""
    __slots__ = ("future",)

    def settle(self, answer: Answer) -> None:
        if not self.future.done():
            self.future.set_result(answer)


class LocalDoor:
    """What a front-door plugin may use of the daemon (see ``dynbatchd_front_doors``)."""

    def __init__(self, daemon: "Daemon"):
        self._daemon = daemon
        self._seq = 0

    @property
    def state(self) -> str:
        return self._daemon.state

    @property
    def models(self) -> dict[str, Any]:
        return dict(self._daemon.config.models)

    @property
    def max_request_bytes(self) -> int:
        return self._daemon.config.daemon.max_request_bytes

    def infer(self, request: P.Request) -> "asyncio.Future[Answer]":
        """Submit `request` as if it came in over ZeroMQ; the future gets its one answer."""
        self._seq += 1
        envelope = LocalEnvelope([b"local:%d" % self._seq])
        envelope.future = asyncio.get_running_loop().create_future()
        problem = validate_request(request, [])
        if problem:
            envelope.settle(Answer(None, P.BAD_REQUEST, problem))
        elif self._daemon.state == "starting":   # the door opens before the models load (probes)
            envelope.settle(Answer(None, P.UNAVAILABLE, "daemon is starting: its models are still loading"))
        else:
            self._daemon.on_request(envelope, request, [])
        return envelope.future
