"""sd_notify without a dependency: tell systemd we are ready, reloading, stopping, alive.

Everything here is a no-op when the daemon was not started by systemd with
Type=notify ($NOTIFY_SOCKET unset).

The watchdog (``WatchdogSec=`` in the unit): systemd sets ``WATCHDOG_USEC``
(and ``WATCHDOG_PID``) and restarts the service when no ``WATCHDOG=1`` arrives
within that time. `start_watchdog` sends it from the asyncio event loop itself,
by ``loop.call_later``, never from a thread: a loop that is blocked or spinning
stops answering requests *and* stops pinging, so systemd notices. A stall of
more than half the timeout may already be fatal, one of a whole timeout
always is.
"""

from __future__ import annotations

import asyncio
import os
import socket


def notify(state: str) -> bool:
    """Send one notification (e.g. "READY=1", "STOPPING=1"); True if it was sent."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
        return True
    except OSError:
        return False


def watchdog_usec() -> int | None:
    """The watchdog timeout systemd expects of this process, in microseconds, or None.

    None when ``WATCHDOG_USEC`` is unset, not a positive integer, or when
    ``WATCHDOG_PID`` is set to another process: then the variables were
    inherited (a worker started by the daemon) and the pings are not ours to send.
    """
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec


def watchdog_interval_s() -> float | None:
    """Seconds between two pings: half the timeout, as sd_watchdog_enabled(3) advises; None without a watchdog."""
    usec = watchdog_usec()
    return None if usec is None else usec / 2 / 1_000_000


class Watchdog:
    """Pings systemd every `interval_s` from the event loop; `cancel()` stops it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float):
        self.loop = loop
        self.interval_s = interval_s
        self.sent = 0          # pings that reached the socket
        self.failed = 0        # pings that could not be sent (systemd gone?): retried next interval
        self._handle: asyncio.Handle | None = loop.call_soon(self._ping)

    def _ping(self) -> None:
        if notify("WATCHDOG=1"):
            self.sent += 1
        else:
            self.failed += 1
        self._handle = self.loop.call_later(self.interval_s, self._ping)

    @property
    def running(self) -> bool:
        return self._handle is not None

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def start_watchdog(loop: asyncio.AbstractEventLoop) -> Watchdog | None:
    """Start pinging systemd's watchdog from `loop` (first ping at once); None when there is no watchdog.

    Call it from the daemon's event loop; the pings run for as long as the
    loop does (also through a drain), or until the handle's ``cancel()``.
    """
    interval = watchdog_interval_s()
    if interval is None or not os.environ.get("NOTIFY_SOCKET"):
        return None
    return Watchdog(loop, interval)
