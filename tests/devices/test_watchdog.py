"""The systemd watchdog, against a real AF_UNIX datagram socket standing in for systemd.

`dynbatchd.systemd.start_watchdog` must ping from the event loop itself: pings
arrive while the loop runs, none while it is blocked (a synchronous wait on a
threading.Event, released by the test), and they resume when it runs again.
Every wait is bounded; none is needed for the order of events.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path

import pytest

from dynbatchd import systemd

pytestmark = pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="sd_notify needs AF_UNIX sockets")

TIMEOUT_USEC = 200_000            # WATCHDOG_USEC of the tests: pings every 0.1 s
INTERVAL_S = TIMEOUT_USEC / 2 / 1e6
QUIET_S = 5 * INTERVAL_S          # how long a blocked loop must stay silent: five intervals
BOUND_S = 10.0                    # the most any expected event may take


@pytest.fixture
def notify_socket(monkeypatch):
    """A datagram socket where systemd's would be (short path: AF_UNIX paths are ~107 bytes at most)."""
    directory = Path(tempfile.mkdtemp(prefix="dbd-wd-"))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(directory / "notify"))
    monkeypatch.setenv("NOTIFY_SOCKET", str(directory / "notify"))
    yield sock
    sock.close()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def watchdog_env(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", str(TIMEOUT_USEC))
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))


def drain(sock: socket.socket) -> list[bytes]:
    """Every datagram already queued, without waiting."""
    got = []
    sock.setblocking(False)
    try:
        while True:
            got.append(sock.recv(4096))
    except BlockingIOError:
        return got
    finally:
        sock.setblocking(True)


def next_datagram(sock: socket.socket, timeout: float) -> bytes | None:
    sock.settimeout(timeout)
    try:
        return sock.recv(4096)
    except socket.timeout:
        return None
    finally:
        sock.settimeout(None)


# ---------------------------------------------------------------------------
# reading the environment
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("usec, pid, expected", [
    (None, None, None),                          # no watchdog
    ("30000000", None, 30_000_000),              # WATCHDOG_PID is optional
    ("30000000", "self", 30_000_000),
    ("30000000", "other", None),                 # inherited from the daemon: a worker must not ping
    ("0", None, None),
    ("-5", None, None),
    ("soon", None, None),
    ("30000000", "not-a-pid", None),
])
def test_watchdog_usec_reads_the_environment(monkeypatch, usec, pid, expected):
    for name, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            value = {"self": str(os.getpid()), "other": str(os.getpid() + 1)}.get(value, value)
            monkeypatch.setenv(name, value)
    assert systemd.watchdog_usec() == expected
    assert systemd.watchdog_interval_s() == (None if expected is None else expected / 2e6)


def test_no_watchdog_without_watchdog_usec(notify_socket, monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    loop = asyncio.new_event_loop()
    try:
        assert systemd.start_watchdog(loop) is None
    finally:
        loop.close()


def test_no_watchdog_without_a_notify_socket(watchdog_env, monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    loop = asyncio.new_event_loop()
    try:
        assert systemd.start_watchdog(loop) is None
    finally:
        loop.close()


def test_no_watchdog_for_another_process(notify_socket, watchdog_env, monkeypatch):
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    loop = asyncio.new_event_loop()
    try:
        assert systemd.start_watchdog(loop) is None
    finally:
        loop.close()


# ---------------------------------------------------------------------------
# pinging from the loop
# ---------------------------------------------------------------------------

async def pings(sock: socket.socket, count: int) -> list[bytes]:
    """`count` datagrams, read by the running loop itself (so it keeps turning meanwhile)."""
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    got = []
    while len(got) < count:
        got.append(await asyncio.wait_for(loop.sock_recv(sock, 4096), BOUND_S))
    return got


def test_pings_arrive_while_the_loop_runs_and_stop_while_it_is_blocked(notify_socket, watchdog_env):
    entered, released = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def observer():
        """Off the loop: once the loop is blocked, nothing may arrive; then let it go."""
        try:
            if not entered.wait(BOUND_S):
                seen["error"] = "the loop never blocked"
                return
            seen["before"] = drain(notify_socket)           # sent before the block began
            seen["during"] = next_datagram(notify_socket, QUIET_S)
        finally:
            released.set()

    async def main():
        watchdog = systemd.start_watchdog(asyncio.get_running_loop())
        assert watchdog is not None and watchdog.interval_s == INTERVAL_S
        assert await pings(notify_socket, 3) == [b"WATCHDOG=1"] * 3
        notify_socket.setblocking(True)
        thread = threading.Thread(target=observer)
        thread.start()
        entered.set()
        released.wait(BOUND_S + QUIET_S + BOUND_S)   # the block: a synchronous wait on the loop's thread
        thread.join(BOUND_S)
        assert not thread.is_alive()
        resumed = await pings(notify_socket, 2)       # the loop turns again: so do the pings
        watchdog.cancel()
        return watchdog, resumed

    watchdog, resumed = asyncio.run(main())
    assert "error" not in seen, seen["error"]
    assert seen["during"] is None, "a ping arrived while the event loop was blocked"
    assert set(seen["before"]) <= {b"WATCHDOG=1"}
    assert resumed == [b"WATCHDOG=1"] * 2
    assert watchdog.sent >= 5 and watchdog.failed == 0 and not watchdog.running


def test_cancel_stops_the_pings(notify_socket, watchdog_env):
    async def main():
        watchdog = systemd.start_watchdog(asyncio.get_running_loop())
        await pings(notify_socket, 1)
        watchdog.cancel()
        drain(notify_socket)
        notify_socket.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.sock_recv(notify_socket, 4096), QUIET_S)
        except asyncio.TimeoutError:
            return None

    assert asyncio.run(main()) is None, "a ping arrived after cancel()"


def test_a_vanished_socket_is_counted_and_retried(notify_socket, watchdog_env, monkeypatch, tmp_path):
    async def main():
        watchdog = systemd.start_watchdog(asyncio.get_running_loop())
        await pings(notify_socket, 1)
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
        while watchdog.failed < 2:   # bounded by the test's timeout below
            await asyncio.sleep(INTERVAL_S / 2)
        watchdog.cancel()
        return watchdog

    watchdog = asyncio.run(asyncio.wait_for(main(), BOUND_S))
    assert watchdog.sent >= 1 and watchdog.failed >= 2
