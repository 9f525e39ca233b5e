"""sd_notify without a dependency: tell systemd we are ready, reloading or stopping.

A no-op when the daemon was not started by systemd with Type=notify
($NOTIFY_SOCKET unset).
"""

from __future__ import annotations

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
