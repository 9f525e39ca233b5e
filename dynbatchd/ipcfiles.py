"""ipc:// socket files: `bind` keeps one to its owner and group and never takes over one a live
daemon holds; `remove_ipc_file` takes it away when the socket closes (libzmq leaves it behind).

Split out of `dynbatchd.transport` because the front end and the control socket both bind.
"""

from __future__ import annotations

import errno
import logging
import os
import socket

import zmq

log = logging.getLogger("dynbatchd.transport")


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

