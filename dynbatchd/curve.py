"""CURVE on the daemon's tcp:// sockets: `CurveServer` admits only the client and admin keys of
its keys directory (a ZAP handler that tells each message's key name and role); a client
refused in the handshake never reaches a handler and is counted (``unauthenticated``).

Split out of `dynbatchd.transport`: security is its own job. Refusals are logged with the
peer's address and public key, never a secret.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any, Callable

import zmq
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

from dynbatchd import config as cfgmod
from dynbatchd.loopsocket import ADMIN, CLIENT, ROLE_PROPERTY, LoopSocket, _Throttle

log = logging.getLogger("dynbatchd.transport")


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
                except Exception as exc:   # never the authenticator's end: that refused every client, admins too
                    log.warning("CURVE: key skipped: %s: %s", key_file, type(exc).__name__)
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

