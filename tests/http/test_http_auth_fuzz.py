"""Faults a fuzzing pass over the HTTP door's API keys and TLS found, end to end: a daemon in a
subprocess serving HTTPS on loopback (a self-signed certificate), keys made with `dynbatchctl http-key`.

- A keys directory its group or others may write admits no key: they could add one for any tenant.
- A key file that could not be read for a moment (EMFILE) is read again, not refused until it changes.
- A request refused before its body (401) over TLS is closed once its body has come, not after
  header_timeout_s: TLS cannot half-close, so the client and the door waited for each other."""

from __future__ import annotations

import json
import os
import resource
import socket
import ssl
import stat
import sys
import time

import pytest

from conftest import free_port, start_daemon
from helpers import wait_until
from test_http_keys import BODY, self_signed, start_keyed_tls_daemon

EMBED = json.dumps({"model": "enc", "input": "one two"}).encode()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    running = start_keyed_tls_daemon(tmp_path_factory.mktemp("httpauthfuzz"), "header_timeout_s = 10\n",
                                     cpu_threads=1)
    yield running
    running.stop()


def connect(daemon) -> ssl.SSLSocket:
    """A TLS connection, its handshake done."""
    raw = socket.create_connection(("127.0.0.1", daemon.port), timeout=20)
    return daemon.tls.wrap_socket(raw, server_hostname="127.0.0.1")


def request_bytes(key: str | None, *, close: bool = False) -> bytes:
    head = [b"POST /v1/embeddings HTTP/1.1", b"Host: localhost", b"Content-Type: application/json",
            b"Content-Length: %d" % len(EMBED)]
    if key is not None:
        head.append(b"Authorization: Bearer " + key.encode())
    if close:
        head.append(b"Connection: close")
    return b"\r\n".join(head) + b"\r\n\r\n" + EMBED


def status_of(connection: ssl.SSLSocket, key: str | None) -> int:
    """Send one request on `connection`; the status of its answer (the head only is read)."""
    connection.sendall(request_bytes(key))
    return int(connection.recv(65536).split(b" ", 2)[1])


def status(daemon, key: str | None) -> int:
    with connect(daemon) as connection:
        return status_of(connection, key)


def test_a_keys_directory_others_may_write_admits_no_key(daemon):
    """Whoever may write KEYS_DIR/http (or KEYS_DIR) could add a key of their own for any tenant:
    while it is so, no key is accepted, and one line says why (CURVE does the same for clients/)."""
    directory = daemon.keys / "http"
    assert status(daemon, daemon.alice) == 200
    for unsafe in (directory, daemon.keys):
        mode = unsafe.stat().st_mode & 0o777
        unsafe.chmod(mode | 0o022)
        try:
            assert status(daemon, daemon.alice) == 401
            assert status(daemon, daemon.alice) == 401
        finally:
            unsafe.chmod(mode)
        assert status(daemon, daemon.alice) == 200
    lines = [line for line in daemon.log_lines() if "group or others may write" in line]
    assert len(lines) == 2 and daemon.alice not in daemon.logs()


def lowest_free_fd(pid: int) -> int:
    used = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
    return next(n for n in range(len(used) + 1) if n not in used)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prlimit and /proc are Linux's")
def test_a_key_file_unreadable_for_a_moment_is_read_again(daemon):
    """Out of file descriptors when a key's file is (re)read (a connection flood, a key just rotated):
    that request is refused, but the key must serve again once descriptors are free, not stay
    refused until its file changes."""
    path = daemon.keys / "http" / "alice.hash"
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 1_000_000))   # changed: read at the next request
    pid = daemon.proc.pid
    limits = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    with connect(daemon) as connection:   # its descriptor taken before the limit
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (lowest_free_fd(pid), limits[1]))
        try:
            refused = status_of(connection, daemon.alice)
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, limits)
    assert refused == 401, "the key file was read although the daemon had no descriptor free"
    wait_until(lambda: status(daemon, daemon.alice) == 200, 10,
               message="a key whose file could not be opened once stays refused")


def test_a_request_refused_before_its_body_is_closed_once_the_body_has_come(daemon):
    """A 401 is answered before the body is read; the door then drops the rest of the body. Over TLS it
    cannot half-close, so it must close once the body's last byte came: a client reading to the close
    (Connection: close) waited header_timeout_s (10 s), holding a connection."""
    with connect(daemon) as connection:
        connection.settimeout(5)
        started = time.monotonic()
        connection.sendall(request_bytes("dbk_alice_wrong", close=True))
        answer = b""
        try:
            while chunk := connection.recv(65536):
                answer += chunk
        except (socket.timeout, TimeoutError):
            pytest.fail("the door kept the connection open after answering 401 and reading the whole body")
        except (ssl.SSLError, ConnectionError):
            pass
    assert answer.startswith(b"HTTP/1.1 401") and time.monotonic() - started < 5


def test_stopping_with_idle_tls_connections_open_logs_no_traceback(tmp_path):
    """A client keeping a connection alive (a pooled client) when the daemon stopped: the door cancelled
    its task, and asyncio logged "Exception in callback" and a traceback at ERROR for each."""
    cert, key = self_signed(tmp_path)
    port = free_port()
    running = start_daemon(tmp_path, BODY + f'\n[http]\nlisten = "127.0.0.1:{port}"\n'
                                            f'tls_cert = "{cert}"\ntls_key = "{key}"\n', cpu_threads=1)
    running.port, running.tls = port, ssl.create_default_context(cafile=str(cert))
    try:
        idle = [connect(running) for _ in range(3)]
        assert status_of(idle[0], None) == 200   # one that served a request, two that never sent one
    finally:
        running.stop()
    for connection in idle:
        connection.close()
    assert "Traceback" not in running.logs() and "Exception in callback" not in running.logs()


def test_a_key_made_under_a_umask_of_002_is_in_directories_only_its_owner_may_write(tmp_path):
    """mkdir's parents take the umask's mode: KEYS_DIR came out 0775, and the door took no key from it."""
    from dynbatchd import httpkeys

    old = os.umask(0o002)
    try:
        key = httpkeys.create(tmp_path / "keys", "app", "bank-a")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "keys").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(tmp_path / "keys" / "http").st_mode) == 0o700
    assert httpkeys.KeyStore(tmp_path / "keys").check(key) is not None


def test_check_config_refuses_http_keys_in_a_directory_others_may_write_naming_the_key(tmp_path):
    """The door takes no key from such a directory: said at check and start, not first as every key refused."""
    from dynbatchd import config as cfgmod
    from dynbatchd.plugins import Plugins
    from dynbatchd.validation import validate_config

    keys = tmp_path / "keys"
    (keys / "http").mkdir(parents=True, mode=0o700)
    keys.chmod(0o700)
    path = tmp_path / "c.toml"
    path.write_text(f'[daemon]\nkeys_dir = "{keys}"\n[models.m]\nrunner = "noop"\n[channels.c]\nmax_batch = 4\n'
                    'window_ms = 1\n[routing]\ndefault = "c"\n[http]\nlisten = "127.0.0.1:8080"\nkeys = true\n')
    validate_config(cfgmod.load(path), Plugins.load())
    (keys / "http").chmod(0o775)
    with pytest.raises(cfgmod.ConfigError, match=r"http\.keys: .*/keys/http is mode 0775: its group or others may write"):
        validate_config(cfgmod.load(path), Plugins.load())
