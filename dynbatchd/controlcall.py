"""`control_call`: one command on the daemon's control socket, blocking, with a clear line when
the daemon is not there or refuses this client's CURVE key in the handshake.
"""

from __future__ import annotations

import math
import time
from typing import Any

import msgspec
import zmq

from dynbatchd import protocol as P
from dynbatchd.clientwire import CurveKeys, DynbatchdError, check_running, timeout_seconds

_HANDSHAKE_FAILED = int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                        | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def _handshake_refusal(monitor: zmq.Socket) -> str | None:
    """Why the daemon refused our CURVE handshake, from the client socket's monitor, or None."""
    from zmq.utils.monitor import recv_monitor_message

    while monitor.poll(0):
        event = recv_monitor_message(monitor)
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return "the daemon refused this client's CURVE key (not among its admitted client keys)"
        if event["event"] & _HANDSHAKE_FAILED:
            return "the CURVE handshake failed (is the server key the daemon's own, and CURVE on there?)"
    return None


def control_call(endpoint: str, cmd: str, timeout_s: float = 5.0, *, curve: CurveKeys | None = None,
                 **args: Any) -> Any:
    """One control-socket request; returns `result` or raises DynbatchdError with the daemon's message.

    `curve`: this client's keys and the daemon's public key, for a tcp:// control socket
    with CURVE on; a refused handshake raises DynbatchdError (code ``refused``) at once, and so
    does nothing listening there (`NotRunning`, code ``not_running``).
    """
    try:
        request = P.encoder.encode({"cmd": cmd, "args": args})
    except (OverflowError, TypeError, ValueError) as exc:   # e.g. an integer msgpack cannot carry
        raise DynbatchdError(f"cannot send {cmd}: {exc}", "bad_request") from None
    limit = timeout_seconds(timeout_s)   # NaN or not a number: BadRequest; inf or None: no limit
    check_running(endpoint)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = None
    try:
        if curve is not None and curve.apply(sock, endpoint):
            monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED)
        _connect(sock, endpoint)
        deadline = time.monotonic() + (math.inf if limit is None else limit)
        while True:   # (Again after POLLOUT: the connection went between the two; wait again)
            _wait_ready(sock, zmq.POLLOUT, monitor, deadline, endpoint, timeout_s)
            try:
                sock.send(request, zmq.NOBLOCK)
                break
            except zmq.Again:
                continue
        _wait_ready(sock, zmq.POLLIN, monitor, deadline, endpoint, timeout_s)
        try:
            reply = msgspec.msgpack.decode(sock.recv())
        except msgspec.DecodeError as exc:
            raise DynbatchdError(f"unreadable answer from {endpoint}: {exc}", "control") from None
    finally:
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(0)
        sock.close(0)
    if not isinstance(reply, dict) or not reply.get("ok"):
        if not isinstance(reply, dict):
            raise DynbatchdError(f"unreadable answer from {endpoint}: {reply!r}", "control")
        raise DynbatchdError(reply.get("error", "control command failed"), "control")
    if "result" not in reply:
        raise DynbatchdError(f"unreadable answer from {endpoint}: ok without a result", "control")
    return reply["result"]


def _wait_ready(sock: zmq.Socket, event: int, monitor: zmq.Socket | None, deadline: float, endpoint: str,
                timeout_s: float) -> None:
    """Wait until `sock` is ready for `event` (POLLOUT to send, POLLIN to receive): DynbatchdError
    ``refused`` as soon as `monitor` sees the CURVE handshake refused, ``unreachable`` at `deadline`.
    The send waits too: a DEALER whose one connection was refused in the handshake has no peer
    left, and a plain send then blocks for good (dynbatchctl with a revoked key hung past its
    timeout)."""
    poller = zmq.Poller()
    poller.register(sock, event)
    if monitor is not None:
        poller.register(monitor, zmq.POLLIN)
    while True:
        ready = dict(poller.poll(_poll_ms(deadline)))
        if ready.get(sock, 0) & event:
            return
        why = _handshake_refusal(monitor) if monitor is not None and monitor in ready else None
        if why:
            raise DynbatchdError(f"{endpoint}: {why}", "refused")
        if not ready or time.monotonic() >= deadline:
            raise DynbatchdError(f"no answer from the daemon's control socket {endpoint} within {timeout_s:g} s "
                                 "(is dynbatchd running?)", "unreachable")


def _connect(sock: zmq.Socket, endpoint: str) -> None:
    """Connect, naming an endpoint ZeroMQ refuses rather than raising its ZMQError."""
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        raise DynbatchdError(f"cannot connect to {endpoint!r}: {exc} (an endpoint is tcp://HOST:PORT or "
                             "ipc://PATH)", "bad_request") from None


def _poll_ms(deadline: float) -> int:
    """Milliseconds left until `deadline` for `poll` (-1: no limit, when the deadline is infinite)."""
    if math.isinf(deadline):
        return -1
    return max(0, int((deadline - time.monotonic()) * 1000))
