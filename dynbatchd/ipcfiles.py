"""ipc:// socket files: `bind` keeps one to its owner and group and never takes over one a live
daemon holds; `remove_ipc_file` takes it away when the socket closes (libzmq leaves it behind);
`WorkerSocketDir` makes the private directory of a daemon's worker sockets, and removes those
that daemons killed outright left behind.

Split out of `dynbatchd.transport` because the front end and the control socket both bind.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
import tempfile

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


class WorkerSocketDir:
    """The private directory (mode 0700) of one daemon's worker sockets, in the temporary directory.

    A clean stop removes it (`remove`); a daemon killed outright (SIGKILL, the OOM killer) cannot.
    So the daemon holds a lock on its directory for as long as it runs, and a daemon starting
    removes the directories whose lock nobody holds: restarts outside systemd's private /tmp
    leave nothing behind. A lock, not a pid, because daemons in other pid namespaces may share
    the directory; the lock is taken before the directory gets the name others look for."""

    PREFIX = "dynbatchd-workers-"

    def __init__(self, base: str | None = None):
        base = base or tempfile.gettempdir()
        remove_stale_worker_dirs(base)
        fresh = tempfile.mkdtemp(prefix="dynbatchd-new-", dir=base)
        self._lock = os.open(fresh, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        # named after the pid too, so no live daemon's directory can have the same name
        suffix = os.path.basename(fresh)[len("dynbatchd-new-"):]
        self.path = os.path.join(base, f"{self.PREFIX}{os.getpid()}-{suffix}")
        os.rename(fresh, self.path)

    def remove(self) -> None:
        """Remove the directory and let go of its lock (the clean stop)."""
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock)


def remove_stale_worker_dirs(base: str) -> None:
    """Remove the worker socket directories under `base` that this user owns and no daemon holds."""
    try:
        names = [name for name in os.listdir(base) if name.startswith(WorkerSocketDir.PREFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(base, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid == os.geteuid() and _take(fd):
                shutil.rmtree(path, ignore_errors=True)
                log.info("removed %s, left by a daemon that is gone", path)
        finally:
            os.close(fd)


def _take(fd: int) -> bool:
    """Lock `fd` now if nobody holds it (then its daemon is gone)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
