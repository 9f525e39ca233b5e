"""Where dynbatchd looks for things on disk: its config file, its runtime (socket) and state
directories. Each has one search order here, which the daemon and dynbatchctl both use.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from dynbatchd.errors import DynbatchdError

if TYPE_CHECKING:
    from dynbatchd.config.schema import DaemonSettings

CONFIG_ENV = "DYNBATCHD_CONFIG"
# The control socket's file name in the runtime directory (see `runtime_dir`).
CONTROL_SOCKET = "control.sock"
# The runtime directory systemd makes for dynbatchd.service (RuntimeDirectory=dynbatchd).
SYSTEM_RUNTIME_DIR = "/run/dynbatchd"
# Where the daemon's CURVE keys live: server.key_secret, server.key, clients/*.key, admins/*.key.
DEFAULT_KEYS_DIR = "/etc/dynbatchd/keys"
# The state directory systemd makes for dynbatchd.service (StateDirectory=dynbatchd).
SYSTEM_STATE_DIR = "/var/lib/dynbatchd"
# Searched in this order after --config and $DYNBATCHD_CONFIG (see `find_config`).
DEFAULT_CONFIG_PATHS = ("etc/dynbatchd.toml", "/etc/dynbatchd/dynbatchd.toml")


def private_runtime_dir(env: dict[str, str] | None = None) -> Path:
    """A directory of this user's own for sockets: ``$XDG_RUNTIME_DIR/dynbatchd``, else
    ``/tmp/dynbatchd-UID``. The daemon creates it mode 0700 (`ensure_private_dir`)."""
    env = os.environ if env is None else env
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        return Path(xdg) / "dynbatchd"
    return Path("/tmp") / f"dynbatchd-{os.getuid()}"


def runtime_dir(env: dict[str, str] | None = None) -> Path:
    """The directory the default control socket lives in; the daemon and dynbatchctl both ask here.

    1. ``$RUNTIME_DIRECTORY`` (the first of its paths): systemd sets it for the
       service (RuntimeDirectory=dynbatchd, so ``/run/dynbatchd``);
    2. ``/run/dynbatchd`` where it exists: the system service is running, so an
       operator's dynbatchctl (or the warmup unit's) finds its socket;
    3. this user's private directory (`private_runtime_dir`), e.g. for a daemon run
       from a checkout.
    """
    env = os.environ if env is None else env
    systemd_dir = env.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if systemd_dir:
        return Path(systemd_dir)
    if os.path.isdir(SYSTEM_RUNTIME_DIR):
        return Path(SYSTEM_RUNTIME_DIR)
    return private_runtime_dir(env)


def default_control(env: dict[str, str] | None = None) -> str:
    """The default ``[daemon] control``: ``ipc://RUNTIME_DIR/control.sock`` (see `runtime_dir`)."""
    return f"ipc://{runtime_dir(env) / CONTROL_SOCKET}"


def default_state_dir(env: dict[str, str] | None = None) -> str:
    """The default ``[daemon] state_dir``: where the daemon and dynbatchctl keep what outlives a
    run (the tuning database, the top-users sketch, promoted settings, the audit log).

    1. ``$STATE_DIRECTORY`` (the first of its paths): systemd sets it for the service
       (StateDirectory=dynbatchd, so ``/var/lib/dynbatchd``);
    2. ``/var/lib/dynbatchd`` where it exists and this user may write it: an operator's
       dynbatchctl (or a timer's) beside the system service;
    3. ``./var`` under the working directory, e.g. for a daemon run from a checkout.
    """
    env = os.environ if env is None else env
    systemd_dir = env.get("STATE_DIRECTORY", "").split(":")[0]
    if systemd_dir:
        return systemd_dir
    if os.path.isdir(SYSTEM_STATE_DIR) and os.access(SYSTEM_STATE_DIR, os.W_OK):
        return SYSTEM_STATE_DIR
    return str(Path.cwd() / "var")


class StateDirError(DynbatchdError, OSError):
    """The state directory cannot be made or used; ``str()`` is one line naming ``daemon.state_dir``.
    An OSError still, so a caller that carries on without the state directory catches it as one."""

    def __str__(self) -> str:
        return f"daemon.state_dir: {self.filename}: {self.strerror}"


def state_path(settings: "DaemonSettings", name: str) -> Path:
    """The file ``name`` in the state directory, which is created (mode 0750) if missing;
    StateDirError when it cannot be (a file of that name, no permission, a read-only disk)."""
    directory = Path(settings.state_dir)
    try:
        directory.mkdir(mode=0o750, parents=True, exist_ok=True)
    except OSError as exc:
        why = "not a directory" if isinstance(exc, (FileExistsError, NotADirectoryError)) else \
            f"cannot be created: {exc.strerror or exc}"
        raise StateDirError(exc.errno or errno.EIO, why, str(directory)) from None
    return directory / name


class UnsafeDirectory(DynbatchdError, OSError):
    """A directory the control socket must not go into; `strerror` says why, in one line."""


def ensure_private_dir(path: str | os.PathLike) -> Path:
    """Create `path` mode 0700 if missing; refuse (UnsafeDirectory) one that another user owns,
    since whoever can reach the control socket can stop the daemon. One of ours that others
    may enter is closed (chmod 0700)."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(errno.ENOTDIR, f"{path} is not a directory")
    if info.st_uid != os.getuid():
        raise UnsafeDirectory(errno.EPERM, f"{path} belongs to uid {info.st_uid}, not to this user "
                                   f"(uid {os.getuid()}): refusing to put the control socket there")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)   # ours, but too open (made by hand?): close it
    return path



def find_config(explicit: str | Path | None = None) -> Path | None:
    """The config file a command reads: the one search order of every dynbatchd and dynbatchctl command.

    1. `explicit` (the command's --config), 2. ``$DYNBATCHD_CONFIG``,
    3. ``./etc/dynbatchd.toml``, 4. ``/etc/dynbatchd/dynbatchd.toml``.
    The first two are returned as given even when no such file exists (reading
    it then fails, naming it); the last two count only where they are files.
    None when no file is found.
    """
    if explicit is not None and str(explicit) != "":
        return Path(explicit)
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV])
    for candidate in map(Path, DEFAULT_CONFIG_PATHS):
        if candidate.is_file():
            return candidate
    return None


def search_order_text() -> str:
    """The search order in words, for error messages."""
    return "--config, $" + CONFIG_ENV + ", " + ", ".join(("./" + p) if not p.startswith("/") else p
                                                         for p in DEFAULT_CONFIG_PATHS)
