"""Clients for dynbatchd: `AsyncClient` (asyncio) and `Client` (blocking, thread-safe).

Both keep many requests in flight on one DEALER socket and match replies by
id. Errors arrive as exceptions, one class per protocol error code, all
subclasses of `DynbatchdError` with a `.code`.

Every request has a timeout, 60 s (`DEFAULT_TIMEOUT_S`) unless the client or
the call sets another; `None` (no limit) only when asked for explicitly. A
request that runs out raises `Timeout`, which is also a `TimeoutError`, and
closing a client fails whatever it still has in flight with `ClientClosed`,
so no caller waits forever on a daemon that went away.

A daemon with ``[daemon] curve`` on takes CURVE clients only on its tcp://
addresses: give each client its key pair and the daemon's public key,
``curve=CurveKeys.load("client.key_secret", "server.key")`` (files from
``dynbatchctl keygen``). A client whose key the daemon does not admit gets no
answer at all (a `Timeout`; `control_call` says "refused" as soon as the
handshake fails). The keys are used on tcp:// endpoints only: ipc:// relies on
file permissions.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from dynbatchd import config as cfgmod, protocol as P


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
class Unavailable(DynbatchdError): code = P.UNAVAILABLE
class Cancelled(DynbatchdError): code = P.CANCELLED
class QuotaExceeded(DynbatchdError): code = P.QUOTA_EXCEEDED


# The protocol's error codes (client-side conditions such as a timeout are not in it).
ERRORS: dict[str, type[DynbatchdError]] = {c.code: c for c in (
    BadRequest, UnknownModel, Overloaded, DeadlineExceeded, ModelError, ShuttingDown, Refused, Unavailable,
    Cancelled, QuotaExceeded)}


@dataclass(frozen=True)
class Result:
    """An answer: `output` (numpy array or plain value) and where the time went."""
    id: int | str
    output: Any
    timing: P.Timing


@dataclass(frozen=True)
class CurveKeys:
    """A client's CURVE key pair and the public key of the daemon it talks to (Z85, 40 bytes each)."""
    public: bytes
    secret: bytes
    server: bytes

    @classmethod
    def load(cls, client_key_file: str | Path, server_key_file: str | Path) -> "CurveKeys":
        """From a client's NAME.key_secret and the daemon's server.key (dynbatchctl keygen);
        `dynbatchd.config.KeyFileError` (a ValueError) names a file that will not do."""
        public, secret = cfgmod.read_key_file(client_key_file, secret=True)
        server, _ = cfgmod.read_key_file(server_key_file)
        return cls(public, secret, server)

    def apply(self, sock: zmq.Socket, endpoint: str) -> bool:
        """Make `sock` a CURVE client of the daemon if `endpoint` is tcp:// (before connect)."""
        if not endpoint.startswith("tcp://"):
            return False
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        return True


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


DEFAULT_TIMEOUT_S = 60.0


class Timeout(DynbatchdError, TimeoutError):
    """No answer within the timeout (the daemon is gone, stuck or unreachable); also a `TimeoutError`."""
    code = "timeout"


class ClientClosed(DynbatchdError):
    """The client was closed while the request was in flight, or before it was sent."""
    code = "closed"


class NotRunning(DynbatchdError):
    """Nothing listens at the daemon's address: it is not running (said at once, not after a timeout)."""
    code = "not_running"


def not_listening(endpoint: str, timeout_s: float = 0.3) -> str | None:
    """Why nothing can be listening at `endpoint`, found in well under a second; None when
    something may be (ZeroMQ itself would only retry quietly until a timeout).

    ipc://: the socket file is missing, or connecting to it is refused (a stale file). tcp://: the
    connection is refused. Anything else (a timeout, no permission) is left for the request to say.
    """
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        abstract = path.startswith("@")
        if not abstract and not os.path.exists(path):
            return f"no socket file {path}"
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target: Any = "\0" + path[1:] if abstract else path
    elif endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        host = host.strip("[]")
        if host in ("*", "0.0.0.0", ""):
            host = "127.0.0.1"
        try:
            info = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
        except (OSError, ValueError):
            return None
        probe = socket.socket(info[0], socket.SOCK_STREAM)
        target = info[4]
    else:
        return None
    probe.settimeout(timeout_s)
    try:
        probe.connect(target)
    except (ConnectionRefusedError, FileNotFoundError):
        return f"nothing listens on {endpoint[len('ipc://'):] if endpoint.startswith('ipc://') else endpoint}"
    except OSError:
        return None
    finally:
        probe.close()
    return None


def check_running(endpoint: str) -> None:
    """Raise `NotRunning` at once when nothing listens at `endpoint` (see `not_listening`)."""
    why = not_listening(endpoint)
    if why is not None:
        raise NotRunning(f"dynbatchd is not running: {why} ({endpoint})")


class _Default:
    def __repr__(self) -> str:
        return "the client's timeout"


CLIENT_TIMEOUT: Any = _Default()   # a call's `timeout` default: the client's own


class AsyncClient:
    """``await AsyncClient(endpoint).infer("minilm", "text")`` -> numpy array.

    `timeout` (seconds, default ``DEFAULT_TIMEOUT_S`` = 60) bounds every
    request, from sending it to its answer, unless a call gives its own; a
    request that runs out raises `Timeout` (a `TimeoutError`). Only an
    explicit ``timeout=None`` waits forever. `close()` fails every request
    still in flight with `ClientClosed`: no call is left waiting on a daemon
    that went away. `curve`: this client's keys and the daemon's public key
    (`CurveKeys`), for a daemon with CURVE on (used on tcp:// only).
    """

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5555", *, timeout: float | None = DEFAULT_TIMEOUT_S,
                 context: zmq.asyncio.Context | None = None, curve: CurveKeys | None = None):
        self.endpoint = endpoint
        self.timeout = timeout
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self._sock, endpoint)
        self._sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self.closed = False

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
        self._fail_pending(ClientClosed("client closed"))
        self._sock.close(0)

    def _fail_pending(self, exc: DynbatchdError) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()   # retrieved: a request whose send never finished does not await it

    async def _read_replies(self) -> None:
        try:
            while True:
                frames = await self._sock.recv_multipart()
                try:
                    reply = P.reply_decoder.decode(frames[0])
                except Exception:
                    continue
                fut = self._pending.pop(reply.id, None)
                if fut is not None and not fut.done():
                    fut.set_result(frames)
        except asyncio.CancelledError:
            raise
        except Exception as exc:   # the socket failed under us: nobody may keep waiting for it
            self._fail_pending(DynbatchdError(f"connection to {self.endpoint} failed: {exc}", "closed"))

    async def infer_result(self, model: str, inputs: Any, *, tags: Iterable[str] = (), request_type: str | None = None,
                           user_frequency: str | None = None, tokens: int | None = None, priority: int | None = None,
                           deadline_ms: float | None = None, tenant: str | None = None, user: str | None = None,
                           timeout: float | None = CLIENT_TIMEOUT) -> Result:
        """Like `infer`, but also returns the reply's timing.

        `timeout`: seconds for this request, sending included (default: the
        client's, 60 s unless set; None: no limit). Raises `Timeout` past it.
        """
        if self.closed:
            raise ClientClosed("client closed")
        limit = self.timeout if timeout is CLIENT_TIMEOUT else timeout
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read_replies())
        req_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        frames_out = build_request(
            req_id, model, inputs, tags=tuple(tags), request_type=request_type, user_frequency=user_frequency,
            tokens=tokens, priority=priority, deadline_ms=deadline_ms, tenant=tenant, user=user)

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
        if isinstance(sent, asyncio.Future):   # its failure is retrieved here, never left to be logged
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def infer(self, model: str, inputs: Any, **kwargs: Any) -> Any:
        """Send one input (text, numpy array or plain value) and return its output."""
        return (await self.infer_result(model, inputs, **kwargs)).output


class Client:
    """Blocking client; thread-safe, with many requests in flight (`submit` returns a Future).

    `timeout` (seconds, default ``DEFAULT_TIMEOUT_S`` = 60) bounds every
    request unless a call gives its own (``timeout=None`` only when asked:
    no limit). Past it the request raises `Timeout` (a `TimeoutError`).
    `close()` resolves every Future still pending with `ClientClosed`, and a
    `submit` after close returns a Future already failed that way. `curve`: as
    for `AsyncClient`.
    """

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5555", *, timeout: float | None = DEFAULT_TIMEOUT_S,
                 curve: CurveKeys | None = None):
        self.endpoint = endpoint
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dynbatchd-client", daemon=True)
        self._thread.start()
        self._futures: set[Future] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._async = self._call(self._make(endpoint, timeout, curve))

    async def _make(self, endpoint: str, timeout: float | None, curve: CurveKeys | None) -> AsyncClient:
        return AsyncClient(endpoint, timeout=timeout, context=zmq.asyncio.Context(), curve=curve)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def submit(self, model: str, inputs: Any, **kwargs: Any) -> Future:
        """Start a request; the Future's result is a `Result` (output plus timing)."""
        fut: Future = Future()
        with self._lock:
            if self._closed:
                fut.set_exception(ClientClosed("client closed"))
                return fut
            self._futures.add(fut)
        fut.add_done_callback(self._forget)
        inner = asyncio.run_coroutine_threadsafe(self._async.infer_result(model, inputs, **kwargs), self._loop)
        inner.add_done_callback(lambda done: self._settle(fut, done))
        return fut

    def _forget(self, fut: Future) -> None:
        with self._lock:
            self._futures.discard(fut)

    @staticmethod
    def _settle(fut: Future, done: Future) -> None:
        """Copy the loop's outcome onto the caller's Future, unless close() settled it first."""
        if fut.done():
            return
        try:
            if done.cancelled():
                fut.set_exception(ClientClosed("client closed"))
            elif done.exception() is not None:
                fut.set_exception(done.exception())
            else:
                fut.set_result(done.result())
        except InvalidStateError:   # settled by close() in between
            pass

    def infer_result(self, model: str, inputs: Any, **kwargs: Any) -> Result:
        return self.submit(model, inputs, **kwargs).result()

    def infer(self, model: str, inputs: Any, **kwargs: Any) -> Any:
        """Send one input and block for its output; raises a `DynbatchdError` subclass on error."""
        return self.infer_result(model, inputs, **kwargs).output

    def close(self) -> None:
        """Stop the client; every request still pending fails with `ClientClosed`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True

        async def _close() -> None:
            self._async.close()   # every request in flight fails with ClientClosed ...
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if tasks:   # ... and its task ends here, its outcome retrieved: no "Task was destroyed" on stderr
                _, stuck = await asyncio.wait(tasks, timeout=5)
                for task in stuck:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            self._async._ctx.destroy(linger=0)

        try:
            self._call(_close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            with self._lock:
                left = list(self._futures)
            for fut in left:   # whatever the loop did not settle before it stopped
                if not fut.done():
                    try:
                        fut.set_exception(ClientClosed("client closed"))
                    except InvalidStateError:
                        pass

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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
    except (OverflowError, TypeError) as exc:   # e.g. an integer msgpack cannot carry
        raise DynbatchdError(f"cannot send {cmd}: {exc}", "bad_request") from None
    check_running(endpoint)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = None
    try:
        if curve is not None and curve.apply(sock, endpoint):
            monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED)
        sock.connect(endpoint)
        sock.send(request)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            ready = dict(poller.poll(left_ms))
            if sock in ready:
                break
            why = _handshake_refusal(monitor) if monitor is not None and monitor in ready else None
            if why:
                raise DynbatchdError(f"{endpoint}: {why}", "refused")
            if not ready or time.monotonic() >= deadline:
                raise DynbatchdError(f"no answer from the daemon's control socket {endpoint} within {timeout_s:g} s "
                                     "(is dynbatchd running?)", "unreachable")
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
    return reply["result"]
