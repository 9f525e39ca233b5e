"""The daemon's top users: a bounded heavy-hitters sketch of requests per user and their inputs.

`dynbatchctl warmup --top-users N` needs to know who asks most and what they
ask; the daemon sees exactly that, so it counts it as requests go by. Users
are counted with Space-Saving (Metwally, Agrawal & El Abbadi, 2005), pruned in
batches: up to 25 % more users than the bound are kept, then the least active
are dropped at once and the highest count dropped becomes the floor a new user
starts from. A user's count is never under its true count and over it by at
most its `error`; every user more active than the floor is kept. Each user
keeps its most frequent inputs the same way. Cost per request: two dict
updates, and a sort once every `users / 4` new users.

The inputs are payload text. They are kept only here and in the state file
``top-users.msgpack`` (mode 0600, in ``[daemon] state_dir``), never logged;
requests of isolated channels are never observed. ``[top_users] users = 0``
turns it off. Texts are kept only where they can serve (data minimisation): the daemon
builds the sketch with ``inputs_per_user = 0`` when the result cache is off, and then it
counts requests per user only, keeps no text, and drops the texts of a sketch saved before.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterator

import msgspec

log = logging.getLogger(__name__)

FILE_NAME = "top-users.msgpack"
FORMAT = 1
SLACK = 1.25      # prune when this many times the bound are held


class UserRecord(msgspec.Struct, array_like=True, gc=False):
    """One user as saved: (tenant, user), requests counted, the most it is over, inputs by count."""
    tenant: str | None
    user: str
    count: int
    error: int
    inputs: list[tuple[str, str, int]]   # (model, text, times asked)


class SavedSketch(msgspec.Struct, gc=False):
    format: int
    observed: int
    floor: int
    users: list[UserRecord]


def encodes(record: UserRecord) -> bool:
    try:
        msgspec.msgpack.encode(record)
    except UnicodeEncodeError:
        return False
    return True


class TopUsers:
    __slots__ = ("limit", "inputs_per_user", "observed", "floor", "_users")

    def __init__(self, users: int = 50_000, inputs_per_user: int = 4):
        # inputs_per_user 0: no text is kept (the cache is off: warmup could not use it)
        self.limit = users
        self.inputs_per_user = inputs_per_user
        self.observed = 0      # requests counted since the sketch began (across restarts)
        self.floor = 0         # the highest count of a user pruned so far
        # (tenant, user) -> [count, error, {(model, text): count}]
        self._users: dict[tuple[str | None, str], list[Any]] = {}

    def __len__(self) -> int:
        return len(self._users)

    def observe(self, tenant: str | None, user: str, model: str, text: str) -> None:
        """Count one request of `user` with input `text` (the request path calls this)."""
        self.observed += 1
        key = (tenant, user)
        entry = self._users.get(key)
        if entry is None:
            if len(self._users) >= self.limit * SLACK:   # before the newcomer, so it is always counted
                self._prune()
            entry = self._users[key] = [self.floor, self.floor, {}]
        entry[0] += 1
        if not self.inputs_per_user:
            return
        inputs = entry[2]
        asked = (model, text)
        inputs[asked] = inputs.get(asked, 0) + 1
        if len(inputs) > 2 * self.inputs_per_user:
            keep = sorted(inputs.items(), key=lambda kv: -kv[1])[:self.inputs_per_user]
            entry[2] = dict(keep)

    def _prune(self) -> None:
        ranked = sorted(self._users.items(), key=lambda kv: -kv[1][0])
        for _, dropped in ranked[self.limit:]:
            self.floor = max(self.floor, dropped[0])
        self._users = dict(ranked[:self.limit])

    def top(self, n: int) -> Iterator[tuple[str | None, str, int, list[tuple[str, str]]]]:
        """The `n` most active users, most active first: (tenant, user, count, [(model, text)]),
        each user's inputs most asked first."""
        ranked = sorted(self._users.items(), key=lambda kv: (-kv[1][0], kv[0][1]))[:n]
        for (tenant, user), (count, _, inputs) in ranked:
            asked = sorted(inputs.items(), key=lambda kv: -kv[1])[:self.inputs_per_user]
            yield tenant, user, count, [mt for mt, _ in asked]

    def count(self, user: str, tenant: str | None = None) -> int:
        entry = self._users.get((tenant, user))
        return entry[0] if entry else 0

    # -- the state file ------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the sketch to `path` atomically, readable by its owner only (it holds payload text)."""
        records = [UserRecord(t, u, c, e, [(m, x, k) for (m, x), k in inputs.items()])
                   for (t, u), (c, e, inputs) in self._users.items()]
        try:
            data = msgspec.msgpack.encode(SavedSketch(FORMAT, self.observed, self.floor, records))
        except UnicodeEncodeError:   # a string no door should have let in: the rest is still saved
            kept = [r for r in records if encodes(r)]
            log.warning("top-users: %d users with text that is not UTF-8 left out of the saved sketch",
                        len(records) - len(kept))
            data = msgspec.msgpack.encode(SavedSketch(FORMAT, self.observed, self.floor, kept))
        path = Path(path)
        partial = path.with_name(path.name + ".partial")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as file:   # (a plain os.write may write only part of a large sketch)
            os.fchmod(fd, 0o600)   # an older file of the same name may have been more open
            file.write(data)
            file.flush()
            os.fsync(fd)
        os.replace(partial, path)

    @classmethod
    def load(cls, path: str | os.PathLike, users: int = 50_000, inputs_per_user: int = 4) -> "TopUsers":
        """The sketch saved at `path`; an empty one if there is none or it cannot be read (logged,
        without its content)."""
        sketch = cls(users, inputs_per_user)
        try:
            saved = msgspec.msgpack.decode(Path(path).read_bytes(), type=SavedSketch)
        except FileNotFoundError:
            return sketch
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("top-users file %s is unreadable (%s); starting a new one", path, type(exc).__name__)
            return sketch
        if saved.format != FORMAT:
            log.warning("top-users file %s has format %s, not %s; starting a new one", path, saved.format, FORMAT)
            return sketch
        sketch.observed, sketch.floor = saved.observed, saved.floor
        sketch._users = {(r.tenant, r.user): [r.count, r.error, {(m, x): k for m, x, k in r.inputs}
                                                               if inputs_per_user else {}]
                         for r in saved.users}
        if len(sketch._users) > users:
            sketch._prune()
        return sketch
