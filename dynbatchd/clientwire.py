"""What both clients share: the error classes (one per protocol error code), `Result`,
`CurveKeys`, the request/reply frame helpers and the is-the-daemon-listening probe.

Split out of `dynbatchd.client` (which re-exports every name here) so the asyncio client, the
blocking client and `control_call` each live in a module of their own.
"""

from __future__ import annotations

import math
import numbers
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from dynbatchd import config as cfgmod, errors, protocol as P


class DynbatchdError(errors.DynbatchdError):
    """What a client raises: the daemon's answer was an error (`code`: one of the protocol's codes,
    a subclass each), or the client's own (timeout, closed, no daemon). Under the package's one base,
    `dynbatchd.errors.DynbatchdError`, so one ``except`` catches a refusal from either side."""
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
    """Header plus frames for one request; numpy arrays travel as a raw frame. An input MessagePack
    cannot carry (an int over 64 bits, an object, a lone surrogate) is `BadRequest` here, before
    anything is sent, as the daemon would answer it."""
    try:
        return _frames_of(req_id, model, inputs, **meta)
    except (OverflowError, TypeError, ValueError, NotImplementedError) as exc:   # UnicodeEncodeError is a ValueError
        raise BadRequest(f"cannot send this request to model {model!r}: {exc}") from None


def _frames_of(req_id: int, model: str, inputs: Any, **meta: Any) -> list[Any]:
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
    """The reply and its output. A tensor its frames cannot hold (a frame missing, a dtype or size
    that does not match) raises `BadReply`: a daemon (or something posing as one) answered wrongly."""
    reply = P.reply_decoder.decode(frames[0])
    if reply.tensor is not None:
        ref = reply.tensor
        why = P.check_tensor(ref, [len(f) for f in frames[1:]])
        if why is not None:
            raise BadReply(f"unreadable reply to request {reply.id!r}: {why}")
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


# What one client holds of a streamed request's chunks not yet read (each counted as its frame's bytes plus
# CHUNK_OVERHEAD for its objects, so a flood of empty chunks is bounded too).
DEFAULT_STREAM_BUFFER_BYTES = 16 << 20
CHUNK_OVERHEAD = 128


class StreamOverflow(DynbatchdError):
    """A stream's unread chunks passed the client's `stream_buffer_bytes`: the consumer fell that far behind,
    or the daemon (or something posing as one) floods it. The stream ends here and the daemon is told to stop."""
    code = "stream_overflow"


def byte_limit(name: str, value: Any) -> int:
    """`value` as a limit in bytes, a whole number of at least 1; else `BadRequest` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise BadRequest(f"{name} must be a whole number of bytes, at least 1, not {value!r}")
    return int(value)


class BadReply(DynbatchdError):
    """The answer to a request could not be read (a tensor without its frame, a field of the wrong
    type): a daemon of another protocol version, or not a dynbatchd at all, is at the endpoint."""
    code = "bad_reply"


def tag_tuple(tags: Any) -> tuple[str, ...]:
    """A request's tags as sent; a bare string is `BadRequest` (iterated, tags="urgent" went out as
    six one-letter tags, and the request was routed as untagged), and so is anything but strings."""
    if isinstance(tags, (str, bytes)):
        raise BadRequest(f"tags takes a list of strings, e.g. tags=[{tags!r}], not the string {tags!r}")
    try:
        found = tuple(tags)
    except TypeError:
        raise BadRequest(f"tags takes a list of strings, not {type(tags).__name__}") from None
    if not all(isinstance(tag, str) for tag in found):
        raise BadRequest("tags takes a list of strings: every tag a string")
    return found


def timeout_seconds(limit: Any) -> float | None:
    """`limit` as a timeout: a number of seconds (0 or less: already run out) or None for no limit.
    NaN or a non-number is `BadRequest` at once: NaN would time every request out unsent."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, numbers.Real) or math.isnan(limit):
        raise BadRequest(f"timeout must be a number of seconds or None, not {limit!r}")
    return float(limit)


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

