"""ZeroMQ on the event loop: the request front end and the control socket.

Knows messages, not batching: it decodes and validates frames into protocol
structs and hands them on, and it sends replies back by ZeroMQ identity. A
malformed message is answered with ``bad_request`` here and goes no further.

Security lives here too: `CurveServer` puts CURVE on the daemon's tcp:// sockets
and admits only the client and admin keys in its keys directory (a ZAP handler,
which tells each message's key name and role); a client refused in the
handshake never reaches a handler and is counted (``unauthenticated``). `bind`
keeps an ipc:// socket's file to its owner and group, and never takes over one
a live daemon holds; `remove_ipc_file` takes it away when the socket closes. Nothing here logs a request's content: a log line names sizes, codes and
endpoints only.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable

import zmq
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

from dynbatchd import config as cfgmod, protocol as P

log = logging.getLogger(__name__)

DRAIN_LIMIT = 128  # messages read per loop turn: small enough that worker results are never kept waiting
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


class LoopSocket:
    """A ZeroMQ socket driven by the event loop's reader callbacks.

    ZeroMQ's file descriptor is edge-triggered and is also consumed by sends,
    so the socket is drained until empty on every wake-up and re-checked
    after every send burst (`kick`). With `user_ids`, each message comes as a
    `Message` carrying its sender's authenticated identity (and with `roles`, its role).
    """

    def __init__(self, sock: zmq.Socket, on_messages: Callable[[list[list[bytes]]], None], *,
                 user_ids: bool = False, roles: bool = False):
        self.sock = sock
        self.on_messages = on_messages   # called with every multipart message read in one pass
        self.user_ids = user_ids or roles
        self.roles = roles
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
        batch = []
        recv, option, busy = self.sock.recv, self.sock.getsockopt, self._busy
        # Each call into ZeroMQ costs 2-8 us on a small VM, so a drain makes as few as it can. Frames
        # come uncopied to read `more` off each one (no RCVMORE per frame). An idle socket (one
        # message a wake-up, or none after a kick) asks EVENTS before each read (~3 us); a busy
        # one reads until zmq.Again (~8 us, once) instead of asking before every message.
        try:
            while len(batch) < DRAIN_LIMIT and (busy or option(_EVENTS) & _POLLIN):
                if self.user_ids:
                    frames, frame = self._recv_with_user_id()
                else:
                    frame = recv(_NOBLOCK, copy=False)
                    frames = [frame.bytes]
                while frame.more:
                    frame = recv(_NOBLOCK, copy=False)
                    frames.append(frame.bytes)
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
        if len(batch) >= DRAIN_LIMIT:
            self.kick()

    def _recv_message(self) -> list[bytes]:
        """One whole multipart message (zmq.Again if none is queued); `_drain` inlines this."""
        if self.user_ids:
            frames, frame = self._recv_with_user_id()
        else:
            frame = self.sock.recv(_NOBLOCK, copy=False)
            frames = [frame.bytes]
        while frame.more:
            frame = self.sock.recv(_NOBLOCK, copy=False)
            frames.append(frame.bytes)
        return frames

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


class _Throttle:
    """At most one log line per `interval_s` for one kind of event; the rest are counted into the next."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0):
        self.log, self.interval_s = logger, interval_s
        self._next_at = 0.0
        self._held = 0

    def warning(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now < self._next_at:
            self._held += 1
            return
        if self._held:
            message, args = message + " (and %d more since the last such line)", (*args, self._held)
        self._held, self._next_at = 0, now + self.interval_s
        self.log.warning(message, *args)


_HANDSHAKE_FAILED = int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                        | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_WHY_PROTOCOL = {
    int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH): "it did not offer CURVE (a client without keys?)",
    int(zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC): "its CURVE handshake did not decrypt (the wrong server key?)",
}


class _Authenticator(AsyncioAuthenticator):
    """pyzmq's ZAP handler on the daemon's loop, admitting the keys of the clients and admins
    directories; each admitted peer's messages carry its key's name (User-Id) and role (the ZAP
    metadata property ``Role``: ADMIN for a key in the admins directory, else CLIENT).

    The directories are read again when a file in them was added, removed or changed since the
    last handshake, so a key is granted or revoked without a restart (for new connections: a
    connected client stays connected). A directory its group or others may write admits no one
    (whoever can write there could admit a key of their own). Each refusal is logged with the
    peer's address and public key (never a secret).
    """

    def __init__(self, ctx: zmq.Context, domain: str, clients_dir: Path, admins_dir: Path | None = None):
        super().__init__(ctx, log=logging.getLogger("dynbatchd.auth"))
        self.domain, self.clients_dir, self.admins_dir = domain, clients_dir, admins_dir
        self.dirs = [d for d in (clients_dir, admins_dir) if d is not None]   # admins last: their role wins
        self.key_names: dict[bytes, str] = {}   # z85 public key -> its file's name (without .key)
        self.admins: set[bytes] = set()         # z85 public keys of the admins directory
        self._seen: Any = None
        self._peer = "?"
        self._role: str | None = None           # of the handshake being answered
        self._refusals = _Throttle(log)

    def _signature(self) -> Any:
        def listing(directory: Path) -> Any:
            try:
                return (os.stat(directory).st_mode, sorted((e.name, e.stat().st_mtime_ns, e.stat().st_size)
                                                           for e in os.scandir(directory) if e.name.endswith(".key")))
            except OSError as exc:
                return exc.errno
        return [listing(d) for d in self.dirs]

    def reload_if_changed(self) -> None:
        signature = self._signature()
        if signature == self._seen:
            return
        self._seen = signature
        names: dict[bytes, str] = {}
        admins: set[bytes] = set()
        for directory in self.dirs:   # one that cannot be read admits no one, not its old keys
            try:
                if cfgmod.writable_by_others(directory):
                    log.warning("CURVE: no key of %s admitted: its group or others may write it (chmod go-w)",
                                directory)
                    continue
            except OSError:
                continue
            for key_file in sorted(directory.glob("*.key")):
                try:
                    public = cfgmod.read_key_file(key_file)[0]
                except cfgmod.KeyFileError as exc:
                    log.warning("CURVE: key skipped: %s", exc)
                    continue
                names[public] = key_file.stem
                if directory == self.admins_dir:
                    admins.add(public)
        self.certs[self.domain] = dict.fromkeys(names, True)
        self.key_names, self.admins = names, admins
        log.info("CURVE: %d client keys admitted from %s%s", len(names) - len(admins), self.clients_dir,
                 f", {len(admins)} admin keys from {self.admins_dir}" if self.admins_dir else "")

    def curve_user_id(self, client_public_key: bytes) -> str:
        """The User-Id each message of this peer carries: its key file's name (what
        ``[compliance] key_tenants`` maps to a tenant)."""
        from zmq.utils import z85

        public = z85.encode(client_public_key)
        return self.key_names.get(public, public.decode("ascii"))

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._peer = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
        self._role = None
        await super().handle_zap_message(msg)

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        from zmq.utils import z85

        self.reload_if_changed()
        allowed, reason = await super()._authenticate_curve(domain, client_key)
        public = z85.encode(client_key)
        if allowed:
            self._role = ADMIN if public in self.admins else CLIENT
        else:
            self._refusals.warning("refused a client from %s: CURVE key %s is not in %s", self._peer,
                                   public.decode("ascii"), " or ".join(map(str, self.dirs)))
        return allowed, reason

    def _send_zap_reply(self, request_id: bytes, status_code: bytes, status_text: bytes,
                        user_id: str = "anonymous") -> None:
        """pyzmq's reply, plus the peer's role as ZAP metadata: libzmq hands it on with every
        message of the connection (``zmq_msg_gets(msg, "Role")``)."""
        if status_code != b"200" or self._role is None:
            return super()._send_zap_reply(request_id, status_code, status_text, user_id)
        name, role = ROLE_PROPERTY.encode(), self._role.encode()
        metadata = bytes([len(name)]) + name + len(role).to_bytes(4, "big") + role
        self.zap_socket.send_multipart([b"1.0", request_id, status_code, status_text,
                                        user_id if isinstance(user_id, bytes) else user_id.encode(), metadata])


class CurveServer:
    """CURVE for the daemon's tcp:// sockets: its key pair, and a ZAP handler that admits only
    the public keys in the clients and admins directories (``[daemon] keys_dir``/clients/*.key,
    ``keys_dir``/admins/*.key; only an admin may change or stop the daemon, see
    `dynbatchd.control.commands.needs_admin`).

    Make it on the running event loop, before the sockets it secures bind. A socket it
    secures (`secure`) requires ZAP (``ZMQ_ZAP_ENFORCE_DOMAIN``): were the handler ever
    gone, handshakes would fail, never pass unchecked. A client refused in the
    handshake (no CURVE, the wrong server key, a key not admitted) gets no data and
    reaches no handler; each refusal is counted by the socket's owner.
    """

    DOMAIN = "dynbatchd"

    def __init__(self, ctx: zmq.Context, secret_key_file: str | os.PathLike, clients_dir: str | os.PathLike,
                 admins_dir: str | os.PathLike | None = None):
        self.public, self.secret = cfgmod.read_key_file(secret_key_file, secret=True)
        self.clients_dir = Path(clients_dir)
        self._auth = _Authenticator(ctx, self.DOMAIN, self.clients_dir, admins_dir and Path(admins_dir))
        self._auth.start()
        self._auth.reload_if_changed()
        self._monitors: list[LoopSocket] = []

    @classmethod
    def for_settings(cls, ctx: zmq.Context, daemon: cfgmod.DaemonSettings) -> "CurveServer | None":
        """The CurveServer `daemon` asks for, or None when no address of it is CURVE's (curve off,
        or only ipc:// addresses)."""
        if not cfgmod.curve_endpoints(daemon):
            return None
        return cls(ctx, cfgmod.server_secret_key_file(daemon), cfgmod.client_keys_dir(daemon),
                   cfgmod.admin_keys_dir(daemon))

    def secure(self, sock: zmq.Socket, endpoint: str, on_refused: Callable[[], None]) -> bool:
        """Make `sock` a CURVE server if `endpoint` is tcp:// (call before bind); `on_refused()`
        is called for every handshake it refuses. False (nothing done) for other endpoints."""
        if not endpoint.startswith("tcp://"):
            return False
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.ZAP_DOMAIN, self.DOMAIN.encode())
        try:
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)   # no ZAP handler: refuse, do not admit
        except (zmq.ZMQError, AttributeError):   # an older libzmq: the handler runs until the socket closes
            log.warning("this libzmq cannot enforce ZAP (ZMQ_ZAP_ENFORCE_DOMAIN)")
        monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED | int(zmq.EVENT_MONITOR_STOPPED))
        monitor.setsockopt(zmq.LINGER, 0)
        throttle = _Throttle(log)

        def on_events(batch: list[list[bytes]]) -> None:
            for frames in batch:
                try:
                    event = parse_monitor_message(frames)
                except Exception:   # not an event: nothing to count
                    continue
                kind, value = int(event["event"]), int(event["value"])
                if kind == zmq.EVENT_MONITOR_STOPPED:   # the secured socket closed
                    self._forget(io)
                    continue
                on_refused()
                if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                    throttle.warning("refused a client on %s: %s", endpoint,
                                     _WHY_PROTOCOL.get(value, f"ZMTP protocol error 0x{value:x}"))
                elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                    throttle.warning("refused a client on %s: its handshake failed (%s)", endpoint,
                                     os.strerror(value) if value else "no detail")

        io = LoopSocket(monitor, on_events)
        self._monitors.append(io)
        io.start(asyncio.get_running_loop())
        return True

    def _forget(self, io: "LoopSocket") -> None:
        io.stop()
        loop = asyncio.get_running_loop()
        loop.call_soon(io.sock.close, 0)   # not while its own reader runs
        if io in self._monitors:
            self._monitors.remove(io)
        if not self._monitors:
            loop.call_soon(self.close)

    def close(self) -> None:
        """Stop the ZAP handler (the sockets it secured refuse every handshake from then on)."""
        for io in self._monitors:
            io.stop()
            io.sock.close(0)
        self._monitors.clear()
        if self._auth.zap_socket is not None:
            self._auth.stop()


def _ipc_path(endpoint: str) -> str:
    return endpoint[len("ipc://"):]


def _ipc_in_use(path: str) -> bool:
    """Someone accepts connections on the ipc:// socket file `path` (binding would steal it)."""
    if path.startswith("@") or not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(path)
            return True
        except OSError:
            return False


def bind(sock: zmq.Socket, endpoint: str, *, mode: int | None = None) -> None:
    """`sock.bind(endpoint)`; for an ipc:// file, first refuse one a live socket holds (libzmq
    would silently unlink it: ``address already in use`` instead), and with `mode` make the file
    that mode (e.g. 0660) and this process's group, created so (umask) rather than opened later."""
    if not endpoint.startswith("ipc://") or _ipc_path(endpoint).startswith("@"):
        sock.bind(endpoint)
        return
    path = _ipc_path(endpoint)
    if _ipc_in_use(path):
        raise zmq.ZMQError(errno.EADDRINUSE)
    if mode is None:
        sock.bind(endpoint)
        return
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(endpoint)
    finally:
        os.umask(old)
    os.chmod(path, mode)
    if os.stat(path).st_gid != os.getegid():
        try:
            os.chown(path, -1, os.getegid())
        except OSError as exc:
            log.warning("cannot give %s to group %d: %s", path, os.getegid(), exc.strerror)


def ipc_file_of(endpoint: str) -> tuple[str, int, int] | None:
    """(path, device, inode) of the file of a bound ipc:// endpoint, or None (not a file)."""
    if not endpoint.startswith("ipc://") or _ipc_path(endpoint).startswith("@"):
        return None
    try:
        info = os.stat(_ipc_path(endpoint))
    except OSError:
        return None
    return _ipc_path(endpoint), info.st_dev, info.st_ino


def remove_ipc_file(bound: tuple[str, int, int] | None) -> None:
    """Remove the socket file `ipc_file_of` saw at bind (libzmq leaves it behind at close), unless
    it is another one by now (a daemon started since): a clean stop leaves no stale socket."""
    if bound is None:
        return
    path, device, inode = bound
    try:
        info = os.stat(path)
        if (info.st_dev, info.st_ino) == (device, inode):
            os.unlink(path)
    except OSError:
        pass


def split_envelope(frames: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """ROUTER frames -> (envelope, body). REQ clients put an empty delimiter after their identity."""
    if len(frames) >= 2 and frames[1] == b"":
        return frames[:2], frames[2:]
    return frames[:1], frames[1:]


MAX_DEADLINE_MS = cfgmod.MAX_MS   # one day: the config's bound on every duration
RequestHandler = Callable[[list[bytes], P.Request, list[bytes]], None]


class FrontEnd:
    """The request socket (ROUTER): decode, validate, hand on; encode and route replies."""

    def __init__(self, ctx: zmq.Context, endpoint: str, max_request_bytes: int, handler: RequestHandler, *,
                 curve: CurveServer | None = None):
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a reply to a client that left is counted, not lost unseen
        # Hard stop far above the policy limit; the policy limit gets a polite reply.
        sock.setsockopt(zmq.MAXMSGSIZE, max(max_request_bytes * 4, 1 << 20))
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
        self.io = LoopSocket(sock, self._on_messages, user_ids=self.curve)
        self.peer: str | None = None   # the message being handled: its sender's CURVE key name, if any
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
        for frames in batch:
            self.peer = frames.user_id if curve else None
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
    if request.cancel:
        return None   # only the id matters
    if not request.model:
        return "a request needs a model"
    given = (request.text is not None) + (request.tensor is not None) + (request.value is not None)
    if given != 1:
        return "a request needs exactly one input: text, tensor or value"
    if request.text is not None and not request.text.strip():
        return "text is empty (or only whitespace): there is nothing to run"
    if request.tokens is not None and request.tokens < 0:
        return "tokens must be >= 0"
    if request.deadline_ms is not None and not 0 < request.deadline_ms <= MAX_DEADLINE_MS:
        return f"deadline_ms must be > 0 and <= {MAX_DEADLINE_MS:g} (one day)"
    if request.tensor is not None:
        return P.check_tensor(request.tensor, [len(f) for f in frames])
    return None
