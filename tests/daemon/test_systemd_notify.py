"""sd_notify, tested against a real AF_UNIX datagram socket standing in for systemd.

`dynbatchd.systemd.notify` alone, then the real daemon in a subprocess: it must
say READY=1 only once it can serve, RELOADING=1 / READY=1 around every SIGHUP
(also a refused one), STOPPING=1 when it starts to drain, and WATCHDOG=1
while it runs under a watchdog (the pinging itself: tests/devices/test_watchdog.py).
"""

from __future__ import annotations

import shutil
import signal
import socket
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import msgspec
import pytest
import zmq

from conftest import Daemon
from dynbatchd import systemd
from dynbatchd.client import control_call

pytestmark = pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="sd_notify needs AF_UNIX sockets")


@pytest.fixture
def short_dir():
    """A directory with a short path: AF_UNIX socket paths are limited to ~107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="dbd-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def systemd_socket(short_dir, monkeypatch):
    """A datagram socket where systemd's would be, with NOTIFY_SOCKET pointing at it."""
    path = short_dir / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()


# ---------------------------------------------------------------------------
# notify()
# ---------------------------------------------------------------------------

def test_no_notify_socket_means_no_systemd(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.notify("READY=1") is False


def test_ready_reaches_the_socket(systemd_socket):
    assert systemd.notify("READY=1") is True
    assert systemd_socket.recv(4096) == b"READY=1"


def test_several_assignments_travel_in_one_datagram(systemd_socket):
    state = "READY=1\nSTATUS=serving on tcp://127.0.0.1:5555\nMAINPID=42"
    assert systemd.notify(state) is True
    assert systemd_socket.recv(4096).decode() == state


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract socket names are Linux-only")
def test_abstract_namespace_socket(monkeypatch):
    name = f"dynbatchd-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert systemd.notify("READY=1") is True
        assert sock.recv(4096) == b"READY=1"


def test_a_socket_that_is_gone_is_not_an_error(short_dir, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", str(short_dir / "nobody-listens"))
    assert systemd.notify("READY=1") is False


# ---------------------------------------------------------------------------
# the daemon's notifications
# ---------------------------------------------------------------------------

CONFIG = """
    [daemon]
    listen = "ipc://{dir}/req.sock"
    control = "ipc://{dir}/ctl.sock"
    drain_timeout_s = 10
    [devices]
    use = ["cpu"]
    [models.noop]
    runner = "noop"
    [channels.standard]
    max_batch = 8
    window_ms = {window_ms}
    deadline_ms = 5000
    {extra}
"""


def write_config(path: Path, directory: Path, window_ms: float, extra: str = "") -> None:
    path.write_text(textwrap.dedent(CONFIG.format(dir=directory, window_ms=window_ms, extra=extra)))


def states(sock: socket.socket, timeout: float) -> str:
    """The next notification, as text."""
    sock.settimeout(timeout)
    return sock.recv(4096).decode()


def test_daemon_tells_systemd_ready_reloading_and_stopping(short_dir, systemd_socket):
    config = short_dir / "dynbatchd.toml"
    write_config(config, short_dir, window_ms=2)
    log = short_dir / "daemon.log"
    control = f"ipc://{short_dir}/ctl.sock"
    daemon = Daemon(config, f"ipc://{short_dir}/req.sock", control, log=log,
                    env={**WITHOUT_WATCHDOG, "NOTIFY_SOCKET": str(short_dir / "notify")}).launch()
    proc = daemon.proc
    try:
        try:
            ready = states(systemd_socket, 120)
        except socket.timeout:
            pytest.fail(f"no READY=1 within 120 s:\n{log.read_text()}")
        lines = ready.splitlines()
        assert lines[0] == "READY=1"
        assert f"MAINPID={proc.pid}" in lines
        # READY=1 comes only once the request socket is bound (ipc:// makes its file at bind time).
        assert (short_dir / "req.sock").exists()
        assert control_call(control, "ping")["state"] == "serving"
        assert_answers(f"ipc://{short_dir}/req.sock")

        # SIGHUP with a good file: RELOADING=1, then READY=1.
        write_config(config, short_dir, window_ms=3)
        proc.send_signal(signal.SIGHUP)
        assert states(systemd_socket, 30) == "RELOADING=1"
        assert states(systemd_socket, 30) == "READY=1"
        assert control_call(control, "config")["channels"]["standard"]["window_ms"] == 3

        # SIGHUP with a file compliance refuses (banking traffic, 900 ms window): the old config stays,
        # and systemd still hears READY=1 so the unit does not hang in "reloading".
        write_config(config, short_dir, window_ms=900, extra='isolated = true\ncarries = ["banking"]')
        proc.send_signal(signal.SIGHUP)
        assert states(systemd_socket, 30) == "RELOADING=1"
        assert states(systemd_socket, 30) == "READY=1"
        assert control_call(control, "config")["channels"]["standard"]["window_ms"] == 3
        assert proc.poll() is None

        # SIGTERM: STOPPING=1, then a clean exit.
        proc.send_signal(signal.SIGTERM)
        assert states(systemd_socket, 30) == "STOPPING=1"
        assert proc.wait(60) == 0, log.read_text()
    finally:
        daemon.kill()


# The environment minus a watchdog of our own (tests run under systemd), so pings do not interleave.
WITHOUT_WATCHDOG = {"WATCHDOG_USEC": None, "WATCHDOG_PID": None}


def test_daemon_pings_the_watchdog_while_it_serves_and_drains(short_dir, systemd_socket):
    config = short_dir / "dynbatchd.toml"
    write_config(config, short_dir, window_ms=2)
    log = short_dir / "daemon.log"
    env = {**WITHOUT_WATCHDOG, "NOTIFY_SOCKET": str(short_dir / "notify"),
           "WATCHDOG_USEC": "1000000"}   # pings every 0.5 s
    # As systemd does: WATCHDOG_PID is the daemon's own pid (exec keeps the shell's), so workers see another.
    daemon = Daemon(config, f"ipc://{short_dir}/req.sock", f"ipc://{short_dir}/ctl.sock", log=log, env=env,
                    wrap=["/bin/sh", "-c", 'WATCHDOG_PID=$$ exec "$@"', "sh"]).launch()
    proc = daemon.proc
    try:
        seen = []
        while not any(s.startswith("READY=1") for s in seen):
            try:
                seen.append(states(systemd_socket, 120))
            except socket.timeout:
                pytest.fail(f"no READY=1 within 120 s (got {seen}):\n{log.read_text()}")
        for _ in range(3):   # at least every half second, while serving
            assert states(systemd_socket, 10) == "WATCHDOG=1", log.read_text()
        proc.send_signal(signal.SIGTERM)
        after = [states(systemd_socket, 30)]
        while after[-1] == "WATCHDOG=1" and len(after) < 10:   # a ping may come before STOPPING=1
            after.append(states(systemd_socket, 30))
        assert after[-1] == "STOPPING=1", after
        assert proc.wait(60) == 0, log.read_text()
    finally:
        daemon.kill()


def assert_answers(endpoint: str) -> None:
    """One request in the wire format of dynbatchd-protocol(7), with a bare DEALER socket."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(msgspec.msgpack.encode({"id": 1, "model": "noop", "text": "hello"}))
        assert sock.poll(30_000), "no reply within 30 s"
        header, *frames = sock.recv_multipart()
        reply = msgspec.msgpack.decode(header)
        assert reply["id"] == 1 and reply["ok"] is True, reply
        assert reply["timing"]["channel"] == "standard"
    finally:
        sock.close()
