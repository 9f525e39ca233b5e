"""User ids as keyed hashes: what the daemon keeps instead of a user's name.

The top-users sketch counts requests per user; a stable pseudonym serves that
as well as the name does, and `dynbatchctl forget USER` finds the user again by
hashing the name it is given. The pseudonym is HMAC-SHA256 of the user id
under a secret of the daemon's own, so whoever reads the state files without
the secret cannot test a guessed name against them (a plain hash could be).

The secret is 32 random bytes in ``user-ids.key`` in ``[daemon] state_dir``,
created mode 0600 on first use and read back at each start. Losing it (or
deleting it on purpose) makes every pseudonym kept so far unmatchable: the
sketch notices (`key_id`) and starts afresh rather than keep records nobody
can erase by name.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

log = logging.getLogger(__name__)

FILE_NAME = "user-ids.key"
SECRET_BYTES = 32


class Pseudonyms:
    """`pseudonyms(user)` -> the user's keyed hash (64 hex digits); `key_id`: which secret made it."""

    __slots__ = ("_secret", "key_id")

    def __init__(self, secret: bytes):
        self._secret = secret
        self.key_id = hmac.new(secret, b"dynbatchd key id", hashlib.sha256).hexdigest()[:16]

    def __call__(self, user: str) -> str:
        return hmac.new(self._secret, user.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()

    @classmethod
    def load(cls, path: str | os.PathLike | None) -> "Pseudonyms":
        """The secret at `path`, created (0600) if there is none. If it cannot be read or written
        (an unwritable state directory), or `path` is None, a secret for this run only, logged:
        pseudonyms then change at the next start, and a saved sketch is started afresh."""
        if path is None:
            return cls(secrets.token_bytes(SECRET_BYTES))
        path = Path(path)
        try:
            return cls(_read_or_create(path))
        except OSError as exc:
            log.error("user-id key %s unavailable (%s): user ids are hashed with a key of this run only",
                      path, exc.strerror or type(exc).__name__)
            return cls(secrets.token_bytes(SECRET_BYTES))


def _read_or_create(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        secret = path.read_bytes()
        if len(secret) < SECRET_BYTES:
            raise OSError(0, f"shorter than {SECRET_BYTES} bytes") from None
        if path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)   # the secret is the pseudonyms' only protection
        return secret
    secret = secrets.token_bytes(SECRET_BYTES)
    with os.fdopen(fd, "wb") as file:
        file.write(secret)
        file.flush()
        os.fsync(file.fileno())
    return secret
