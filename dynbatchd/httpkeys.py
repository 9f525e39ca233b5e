"""API keys of the HTTP door, kept only as hashes: one file per key in ``KEYS_DIR/http/NAME.hash``.

A key is ``dbk_NAME_SECRET`` (SECRET: 32 random bytes, URL-safe base64), shown once by
``dynbatchctl http-key create NAME --tenant T``. Its file (mode 0600) holds the SHA-256 of the
whole key (the secret has 256 bits: no slow hash is needed), the tenant its requests run as and,
optionally, the channels it may reach. Removing the file revokes the key: the door looks at the key's
file at each request (one stat; read again when it changed), so no restart is needed; only a
regular file of at most 64 KiB is read (`read_key_file`), since the read is on the event loop. Keys are compared with `hmac.compare_digest`, and an unknown name is compared against a
dummy hash, so the time taken says nothing of which part was wrong.

Whoever may write ``KEYS_DIR`` or ``KEYS_DIR/http`` can add a key of their own for any tenant, so no
key is taken from such a directory (as CURVE takes none from such a ``clients/``). A file that could
not be opened or read (an OSError: EMFILE while connections flood the daemon, EIO) is read again at
the next request: only what the file itself holds is remembered until it changes.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from dynbatchd.config.keys import make_dirs_others_cannot_write
from dynbatchd.errors import DynbatchdError

log = logging.getLogger(__name__)

SUBDIR = "http"
SUFFIX = ".hash"
PREFIX = "dbk_"
NAME = re.compile(r"^[A-Za-z0-9-]{1,64}$")   # no "_": the key's name ends at the first one
DUMMY = hashlib.sha256(b"no such key").hexdigest()
# A key file holds ~150 bytes (a hash, a tenant, a few channel names); 64 KiB leaves room for
# hundreds of channels and bounds what one request can make the door read on the event loop.
MOST_BYTES = 64 * 1024


class KeyRecord(msgspec.Struct, forbid_unknown_fields=True):
    sha256: str
    tenant: str
    channels: list[str] = []


@dataclass(frozen=True)
class Caller:
    """Who an accepted key says the caller is."""
    name: str
    tenant: str
    channels: tuple[str, ...]


def keys_dir(keys_root: str | os.PathLike) -> Path:
    return Path(keys_root) / SUBDIR


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def _make_private(directory: Path) -> None:
    """Make KEYS_DIR/http (mode 0700) and its missing parents, none writable by group or others
    whatever the umask: the door takes no key from a directory its group may write
    (`KeyStore._directory_is_safe`)."""
    made = not directory.exists()
    make_dirs_others_cannot_write(directory)
    if made:
        os.chmod(directory, 0o700)


def create(keys_root: str | os.PathLike, name: str, tenant: str, channels: list[str] = (), *,
           force: bool = False) -> str:
    """Make a key for `name`, store its hash, and return the key (shown once, never stored)."""
    if not NAME.match(name):
        raise ValueError(f"{name!r} is not a key name: letters, digits and '-', at most 64")
    if not tenant:
        raise ValueError("a key needs a tenant")
    directory = keys_dir(keys_root)
    _make_private(directory)
    path = directory / f"{name}{SUFFIX}"
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists (--force replaces it, revoking the old key)")
    key = f"{PREFIX}{name}_{secrets.token_urlsafe(32)}"
    partial = path.with_name(path.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(msgspec.json.encode(KeyRecord(digest(key), tenant, list(channels))) + b"\n")
    os.replace(partial, path)   # atomic: a new inode, so the door reads it again
    return key


def revoke(keys_root: str | os.PathLike, name: str) -> bool:
    """Remove `name`'s key; True if there was one."""
    try:
        (keys_dir(keys_root) / f"{name}{SUFFIX}").unlink()
    except FileNotFoundError:
        return False
    return True


def read_all(directory: Path) -> dict[str, KeyRecord]:
    """Every readable key file of `directory`, by name; a bad file is logged (its name only) and skipped."""
    records: dict[str, KeyRecord] = {}
    try:
        entries = sorted(directory.iterdir())
    except FileNotFoundError:
        return records
    for path in entries:
        if path.suffix != SUFFIX or not NAME.match(path.stem):
            continue
        record = read_key_file(path)
        if record is not None:
            records[path.stem] = record
    return records


def read_key_file(path: Path) -> KeyRecord | None:
    """The record of one key file, or None (logged once, by name and reason, never its content)."""
    return read_key_file_lasting(path)[0]


def read_key_file_lasting(path: Path, *, log_failure: bool = True) -> tuple[KeyRecord | None, bool]:
    """(the record of one key file or None, whether that outcome lasts until the file changes).

    Only a regular file of at most MOST_BYTES is read: the door reads on the event loop, where
    a link to /dev/zero would be read forever and a FIFO would block it (hence O_NONBLOCK, and
    the type checked on the open descriptor, not on a name that may change in between). An OSError
    does not last: out of file descriptors for a moment, a good key must not stay refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise _Refused("not a regular file")
            data = os.read(fd, MOST_BYTES + 1)
        finally:
            os.close(fd)
        if len(data) > MOST_BYTES:
            raise _Refused(f"larger than {MOST_BYTES // 1024} KiB")
        return msgspec.json.decode(data, type=KeyRecord), True
    except _Refused as exc:
        reason, lasting = str(exc), True
    except OSError as exc:
        reason, lasting = type(exc).__name__ + (f" {errno.errorcode.get(exc.errno, '')}" if exc.errno else ""), False
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        reason, lasting = type(exc).__name__, True
    if log_failure:
        log.warning("HTTP key file %s is unreadable (%s): that key is refused%s", path, reason.strip(),
                    "" if lasting else " until it can be read")
    return None, lasting


class _Refused(DynbatchdError):
    """A key file that is not read at all (not a regular file, too large)."""


class KeyStore:
    """The HTTP door's view of the key directory: each request's key file is looked at (one stat),
    and read again when it changed, so a key revoked (its file removed) or replaced is refused at once."""

    def __init__(self, keys_root: str | os.PathLike):
        self.directory = keys_dir(keys_root)
        self._records: dict[str, tuple[Any, KeyRecord | None]] = {}   # name -> (file stamp, record)
        self._unreadable: dict[str, Any] = {}   # name -> stamp of a file an OSError kept from being read (logged)
        self._unsafe_logged: tuple[str, int] | None = None   # (directory, mode) last logged as writable by others

    def __len__(self) -> int:
        return len(read_all(self.directory))

    def _record(self, name: str) -> KeyRecord | None:
        if not NAME.match(name):
            return None
        path = self.directory / f"{name}{SUFFIX}"
        try:
            info = os.stat(path)
        except OSError:   # revoked, or never made
            self._records.pop(name, None)
            return None
        stamp = (info.st_ino, info.st_mtime_ns, info.st_ctime_ns, info.st_size)
        cached = self._records.get(name)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        record, lasting = read_key_file_lasting(path, log_failure=self._unreadable.get(name) != stamp)
        if len(self._records) > 100_000:
            self._records.clear()
            self._unreadable.clear()
        if lasting:   # a bad file is logged once: its stamp is kept with its None
            self._records[name] = (stamp, record)
            self._unreadable.pop(name, None)
        else:   # read again at the next request, logged again only once the file changed
            self._records.pop(name, None)
            self._unreadable[name] = stamp
        return record

    def _directory_is_safe(self) -> bool:
        """False while the group or others may write KEYS_DIR or KEYS_DIR/http: they could add a key
        of their own, for any tenant. Logged once per directory and mode; a missing one is safe
        (it holds no key)."""
        for directory in (self.directory.parent, self.directory):
            try:
                mode = os.stat(directory).st_mode
            except OSError:
                continue
            if mode & 0o022:   # (as `dynbatchd.config.writable_by_others`, with the mode kept for the log)
                if self._unsafe_logged != (str(directory), mode):
                    self._unsafe_logged = (str(directory), mode)
                    log.warning("HTTP keys: no key of %s is accepted: its group or others may write it "
                                "(chmod go-w %s)", directory, directory)
                return False
        self._unsafe_logged = None
        return True

    def check(self, key: str | None) -> Caller | None:
        """The caller `key` stands for, or None (no key, a malformed or wrong one, a revoked one)."""
        name = ""
        if key and key.startswith(PREFIX):
            name = key[len(PREFIX):].partition("_")[0]
        record = self._record(name) if name and self._directory_is_safe() else None
        expected = record.sha256 if record is not None else DUMMY
        same = hmac.compare_digest(digest(key or ""), expected)
        if record is None or not same:
            return None
        return Caller(name, record.tenant, tuple(record.channels))


def presented_key(headers: dict[str, str]) -> str | None:
    """The key of a request: ``Authorization: Bearer KEY`` (as OpenAI clients send it) or ``X-Api-Key``."""
    auth = headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return headers.get("x-api-key") or None
