"""CURVE key files: reading, checking and writing the key pairs of the daemon and its clients."""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

from dynbatchd.config.schema import DaemonSettings
from dynbatchd.errors import DynbatchdError, OptionError

# -- CURVE key files ---------------------------------------------------------------
# pyzmq's certificate format (what zmq.auth.load_certificate reads and zmq.auth's
# configure_curve looks for): NAME.key holds a public key, NAME.key_secret the pair.
# The daemon's own pair is KEYS_DIR/server.key_secret (server.key is the half its clients
# need); the keys it admits are the KEYS_DIR/clients/*.key files (requests and reading the
# daemon's state) and the KEYS_DIR/admins/*.key files (all that, and changing or stopping it).

SERVER_KEY_NAME = "server"
CLIENTS_DIR = "clients"
ADMINS_DIR = "admins"
_KEY_NAME_RE = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]*$")


class KeyFileError(DynbatchdError, ValueError):
    """A key file that cannot be used; `str()` names the file and what is wrong, on one line."""


def server_secret_key_file(daemon: DaemonSettings) -> Path:
    return Path(daemon.keys_dir) / f"{SERVER_KEY_NAME}.key_secret"


def server_public_key_file(daemon: DaemonSettings) -> Path:
    return Path(daemon.keys_dir) / f"{SERVER_KEY_NAME}.key"


def client_keys_dir(daemon: DaemonSettings) -> Path:
    return Path(daemon.keys_dir) / CLIENTS_DIR


def admin_keys_dir(daemon: DaemonSettings) -> Path:
    return Path(daemon.keys_dir) / ADMINS_DIR


def writable_by_others(directory: str | os.PathLike) -> bool:
    """Its group or other users may write `directory` (OSError if it cannot be looked at):
    whoever can write a keys directory can admit a key of their own."""
    return bool(os.stat(directory).st_mode & 0o022)


def curve_endpoints(daemon: DaemonSettings) -> list[str]:
    """The addresses CURVE secures: every tcp:// one of listen and control, when curve is on.
    ipc:// sockets keep relying on file permissions."""
    return [ep for ep in (daemon.listen, daemon.control) if daemon.curve and ep.startswith("tcp://")]


def _valid_z85_key(key: bytes) -> bool:
    from zmq.utils import z85

    if len(key) != 40:
        return False
    try:
        return len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):
        return False


KEY_FILE_BYTES = 64 * 1024   # a key file holds ~200 bytes; pyzmq reads the whole file


def read_key_file(path: str | os.PathLike, *, secret: bool = False) -> tuple[bytes, bytes | None]:
    """(public, secret or None) z85 keys of a key file; `secret`: the file must hold the secret half.

    Raises KeyFileError naming the file. A file with a secret key that other users
    may read (or that its group may write) is refused, as ssh refuses such a key.
    """
    from zmq.auth import load_certificate

    path = Path(path)
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):   # before any open: a FIFO's open blocks (the event loop, in the daemon)
            raise KeyFileError(f"{path}: not a file")
        if info.st_size > KEY_FILE_BYTES:
            raise KeyFileError(f"{path}: larger than {KEY_FILE_BYTES // 1024} KiB: not a key file")
        with path.open("rb"):
            pass
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        public, secret_key = load_certificate(path)
    except Exception:   # pyzmq's parser: ValueError, or IndexError on a "public-key" line without "="
        raise KeyFileError(f"{path}: no public-key line: not a key file (dynbatchctl keygen writes them)") from None
    if not _valid_z85_key(public):
        raise KeyFileError(f"{path}: public-key is not a Z85 CURVE key (40 characters)")
    if secret_key is not None:
        if not _valid_z85_key(secret_key):
            raise KeyFileError(f"{path}: secret-key is not a Z85 CURVE key (40 characters)")
        if info.st_mode & 0o027:
            raise KeyFileError(f"{path}: holds a secret key but its mode is {stat.S_IMODE(info.st_mode):04o}: "
                               "other users may read it or its group change it (chmod 600)")
    elif secret:
        raise KeyFileError(f"{path}: has no secret-key: give the NAME.key_secret file, not the public NAME.key")
    return public, secret_key


def _write_new(path: Path, text: str, mode: int, force: bool) -> None:
    """Write `text` to `path` with exactly `mode` (whatever the umask), atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        if force:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)      # fails if `path` appeared meanwhile: never overwrite unasked
    finally:
        if tmp.exists():
            tmp.unlink()


def make_dirs_others_cannot_write(directory: Path) -> None:
    """Make `directory` and its missing parents, none writable by group or others: mkdir takes the
    umask's mode (0775 under a umask of 002), and the daemon refuses a keys directory its group may
    write (`writable_by_others`), so keys made into a new clients/ were refused at the next start."""
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    for made in missing:
        os.chmod(made, stat.S_IMODE(os.stat(made).st_mode) & ~0o022)


def write_keypair(directory: str | os.PathLike, name: str, *, force: bool = False) -> tuple[Path, Path, str]:
    """A new CURVE key pair (zmq.curve_keypair) as DIRECTORY/NAME.key (public, mode 0644) and
    DIRECTORY/NAME.key_secret (both halves, mode 0600); returns (public file, secret file, public key).

    Refuses (FileExistsError) to replace existing files unless `force`.
    """
    import zmq

    if not _KEY_NAME_RE.match(name):
        raise OptionError("NAME", f"{name!r} is not a key name (letters, digits, '.', '_', '-')")
    directory = Path(directory)
    public_file, secret_file = directory / f"{name}.key", directory / f"{name}.key_secret"
    for existing in (public_file, secret_file):
        if existing.exists() and not force:
            raise FileExistsError(errno.EEXIST, f"{existing} exists (--force replaces it)")
    make_dirs_others_cannot_write(directory)
    public, secret = (k.decode("ascii") for k in zmq.curve_keypair())
    curve = f'curve\n    public-key = "{public}"\n'
    _write_new(secret_file, "#   ZeroMQ CURVE **Secret** Certificate, written by dynbatchctl keygen.\n"
                            "#   DO NOT GIVE THIS FILE TO ANYONE; keep it mode 0600.\n\nmetadata\n"
                            + curve + f'    secret-key = "{secret}"\n', 0o600, force)
    _write_new(public_file, "#   ZeroMQ CURVE Public Certificate, written by dynbatchctl keygen.\n"
                            "#   Give it to the other side: a client's goes into the daemon's keys_dir/clients/\n"
                            "#   (an admin's into keys_dir/admins/),\n"
                            "#   the daemon's server.key to its clients.\n\nmetadata\n" + curve, 0o644, force)
    return public_file, secret_file, public
