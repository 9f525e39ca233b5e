"""The daemon's top users: a bounded heavy-hitters sketch of requests per user and their inputs.

`dynbatchctl warmup --top-users N` needs to know who asks most and what they
ask; the daemon sees exactly that, so it counts it as requests go by. Users
are counted with Space-Saving (Metwally, Agrawal & El Abbadi, 2005), pruned in
batches: up to 25 % more users than the bound are kept, then the least active
are dropped at once and the highest count dropped becomes the floor a new user
starts from. A user's count is never under its true count (within the
retention below) and over it by at most its `error`; every user more active
than the floor is kept. Each user keeps its most frequent inputs the same way.
Cost per request: an HMAC, two dict updates, and a sort once every `users / 4`
new users.

Data minimisation. The inputs are payload text. They are kept only here and in
the state file ``top-users.msgpack`` (mode 0600, in ``[daemon] state_dir``),
never logged; requests of isolated channels are never observed. ``[top_users]
users = 0`` turns it off.

- Texts are kept only where they can serve: the daemon builds the sketch with
  ``inputs_per_user = 0`` when the result cache is off, and then it keeps no
  text, and drops the texts of a sketch saved before.
- Retention: each text and each user carries when it was last seen (wall-clock
  seconds, from the injected `clock`). A text not asked for ``retain_days`` is
  dropped, and so is a user not seen for that long, count and all: on observe
  (a sweep at most every `SWEEP_S`), on save and on load.
- Bytes: a text over `MAX_TEXT_BYTES` (16 KiB of UTF-8) is counted but not kept, and the texts
  kept hold at most `TEXT_BUDGET` bytes (64 MiB) in all, in memory and so in the file: past it,
  the least asked texts (the oldest first among equals) are dropped until a quarter of the budget
  is free again. Both are constructor arguments (``[top_users] max_text_bytes`` and
  ``text_budget_bytes``); a file saved under larger bounds is cut to these at load. A warmup input is a request's text, which is rarely long; without a bound, a thousand
  users sending 1 MiB each would hold a gigabyte for a cache that warms short inputs.
- Users are kept as a keyed hash of their id (`dynbatchd.pseudonyms`), never by
  name: counting needs only a stable id, and `forget` hashes the name it is
  given. The file records which key made them (`key_id`); loaded under another
  key the sketch starts afresh (its pseudonyms could no longer be matched).
- A file of the first format (plain user ids, texts with no date) is converted
  at load: each id is hashed, counts kept, and every text dropped, since its age
  cannot be known.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import msgspec

log = logging.getLogger(__name__)

FILE_NAME = "top-users.msgpack"
FORMAT = 2
SLACK = 1.25      # prune when this many times the bound are held
DAY_S = 86_400
SWEEP_S = 3_600   # observe sweeps expired texts and users at most this often
MAX_TEXT_BYTES = 16 << 10   # a longer text is counted, not kept
TEXT_BUDGET = 64 << 20      # bytes of text kept in all
LOW_WATER = 0.75            # over the budget, texts are dropped until this share of it is held

# path -> the problem last logged of the file there. The daemon loads the file at start and the
# built-in warmup plugin once per model at each warmup: a file that stays unreadable was logged
# at every load (a directory in its place: 3 lines in one run). Logged again once it changes.
_logged_problems: dict[str, str] = {}
_LOGGED_PATHS = 64   # paths remembered (a daemon has one; tests and tools make more)


def _warn_once(path: str | os.PathLike, problem: str, message: str, *args: Any) -> None:
    """Log `message` about the file at `path`, unless `problem` is what was last logged of it."""
    key = str(path)
    if _logged_problems.get(key) == problem:
        return
    if len(_logged_problems) >= _LOGGED_PATHS and key not in _logged_problems:
        _logged_problems.pop(next(iter(_logged_problems)))
    _logged_problems[key] = problem
    log.warning(message, *args)


def _read_fine(path: str | os.PathLike) -> None:
    """The file at `path` was read (or is absent): its next problem is logged."""
    _logged_problems.pop(str(path), None)


def text_size(text: str) -> int:
    """`text`'s size in UTF-8 bytes, without encoding it when it is ASCII (the common case)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def plain(user: str) -> str:
    """No pseudonym: the id as given (tests and tools reading a sketch; the daemon always hashes)."""
    return user


class UserRecord(msgspec.Struct, array_like=True, gc=False):
    """One user as saved: (tenant, user key), requests counted, the most it is over, when last
    seen, inputs by count."""
    tenant: str | None
    user: str
    count: int
    error: int
    last_seen: int
    inputs: list[tuple[str, str, int, int]]   # (model, text, times asked, last asked)


class SavedSketch(msgspec.Struct, gc=False):
    format: int
    observed: int
    floor: int
    key_id: str            # the pseudonym key's id; "" for plain ids
    users: list[UserRecord]


class Format(msgspec.Struct):
    format: int


class FirstFormat(msgspec.Struct, gc=False):
    """A file saved before retention and pseudonyms: plain ids, texts without a date."""
    format: int
    observed: int
    floor: int
    users: list[tuple[str | None, str, int, int, list[tuple[str, str, int]]]]


def encodes(record: UserRecord) -> bool:
    try:
        msgspec.msgpack.encode(record)
    except UnicodeEncodeError:
        return False
    return True


class TopUsers:
    __slots__ = ("limit", "inputs_per_user", "observed", "floor", "_users", "pseudonym", "retain_s", "clock",
                 "_next_sweep", "max_text_bytes", "text_budget", "_text_bytes")

    def __init__(self, users: int = 50_000, inputs_per_user: int = 4, *,
                 pseudonym: Callable[[str], str] = plain, retain_days: float = 30.0,
                 clock: Callable[[], float] = time.time, max_text_bytes: int = MAX_TEXT_BYTES,
                 text_budget: int = TEXT_BUDGET):
        # inputs_per_user 0: no text is kept (the cache is off: warmup could not use it)
        self.limit = users
        self.inputs_per_user = inputs_per_user
        self.max_text_bytes = max_text_bytes   # a longer text is counted but not kept
        self.text_budget = text_budget         # bytes of text kept in all (see the module docstring)
        self._text_bytes = 0   # bytes of text added since the last recount: never under what is held
        self.pseudonym = pseudonym       # user id -> what is kept (a `Pseudonyms` in the daemon)
        self.retain_s = retain_days * DAY_S
        self.clock = clock
        self.observed = 0      # requests counted since the sketch began (across restarts)
        self.floor = 0         # the highest count of a user pruned so far
        # (tenant, user key) -> [count, error, last seen, {(model, text): [count, last seen]}]
        self._users: dict[tuple[str | None, str], list[Any]] = {}
        self._next_sweep = 0.0

    def __len__(self) -> int:
        return len(self._users)

    @property
    def key_id(self) -> str:
        return getattr(self.pseudonym, "key_id", "")

    def observe(self, tenant: str | None, user: str, model: str, text: str) -> None:
        """Count one request of `user` with input `text` (the request path calls this)."""
        now = self.clock()
        if now >= self._next_sweep:
            self.expire(now)
        self.observed += 1
        key = (tenant, self.pseudonym(user))
        entry = self._users.get(key)
        if entry is None:
            if len(self._users) >= self.limit * SLACK:   # before the newcomer, so it is always counted
                self._prune()
            entry = self._users[key] = [self.floor, self.floor, now, {}]
        entry[0] += 1
        entry[2] = now
        if not self.inputs_per_user:
            return
        inputs = entry[3]
        asked = (model, text)
        seen = inputs.get(asked)
        if seen is not None:
            seen[0] += 1
            seen[1] = now
        elif (size := self._kept_size(text)) is not None:
            inputs[asked] = [1, now]
            self._text_bytes += size
            if self._text_bytes > self.text_budget:
                self._fit_texts(self.text_budget * LOW_WATER)
        if len(inputs) > 2 * self.inputs_per_user:
            keep = sorted(inputs.items(), key=lambda kv: -kv[1][0])[:self.inputs_per_user]
            entry[3] = dict(keep)

    def _kept_size(self, text: str) -> int | None:
        """The bytes `text` would hold, or None when it is too long to keep (told by its length
        first: UTF-8 takes at least a byte a character)."""
        if len(text) > self.max_text_bytes:
            return None
        size = text_size(text)
        return size if size <= self.max_text_bytes else None

    def _fit_texts(self, keep: float) -> None:
        """Recount the bytes of text held (texts dropped elsewhere are not subtracted, so the running
        count only overstates it) and, over `keep`, drop the least asked texts, the oldest first
        among equals, until under it. Dropping down to a low-water mark makes this sort rare."""
        held, total = [], 0
        for entry in self._users.values():
            inputs = entry[3]
            for asked, (times, at) in inputs.items():
                size = text_size(asked[1])
                held.append((times, at, size, asked, inputs))
                total += size
        if total > keep:
            held.sort(key=lambda h: (h[0], h[1]))
            for _, _, size, asked, inputs in held:
                if total <= keep:
                    break
                del inputs[asked]
                total -= size
        self._text_bytes = total

    def expire(self, now: float | None = None) -> int:
        """Drop texts not asked, and users not seen, for `retain_days`; the number of texts dropped."""
        now = self.clock() if now is None else now
        self._next_sweep = now + min(SWEEP_S, self.retain_s / 24)
        oldest = now - self.retain_s
        dropped = 0
        for key in [k for k, e in self._users.items() if e[2] < oldest]:
            dropped += len(self._users.pop(key)[3])
        for entry in self._users.values():
            inputs = entry[3]
            stale = [asked for asked, (_, seen) in inputs.items() if seen < oldest]
            for asked in stale:
                del inputs[asked]
            dropped += len(stale)
        return dropped

    def _prune(self) -> None:
        ranked = sorted(self._users.items(), key=lambda kv: -kv[1][0])
        for _, dropped in ranked[self.limit:]:
            self.floor = max(self.floor, dropped[0])
        self._users = dict(ranked[:self.limit])

    def top(self, n: int) -> Iterator[tuple[str | None, str, int, list[tuple[str, str]]]]:
        """The `n` most active users, most active first: (tenant, user key, count, [(model, text)]),
        each user's inputs most asked first."""
        ranked = sorted(self._users.items(), key=lambda kv: (-kv[1][0], kv[0][1]))[:n]
        for (tenant, user), (count, _, _, inputs) in ranked:
            asked = sorted(inputs.items(), key=lambda kv: -kv[1][0])[:self.inputs_per_user]
            yield tenant, user, count, [mt for mt, _ in asked]

    def count(self, user: str, tenant: str | None = None) -> int:
        entry = self._users.get((tenant, self.pseudonym(user)))
        return entry[0] if entry else 0

    def forget(self, user: str, tenants: Any = None) -> tuple[str, dict[str | None, list[tuple[str, str]]]]:
        """Erase `user` of every tenant (or of those in `tenants` only): (its key, {tenant: its
        inputs erased}), the inputs looked up before they go."""
        key = self.pseudonym(user)
        gone = [k for k in self._users if k[1] == key and (tenants is None or k[0] in tenants)]
        return key, {k[0]: list(self._users.pop(k)[3]) for k in gone}

    # -- the state file ------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the sketch to `path` atomically, readable by its owner only (it holds payload text),
        after dropping what is past its retention."""
        self.expire()
        records = [UserRecord(t, u, c, e, int(seen), [(m, x, k, int(at)) for (m, x), (k, at) in inputs.items()])
                   for (t, u), (c, e, seen, inputs) in self._users.items()]
        try:
            data = msgspec.msgpack.encode(SavedSketch(FORMAT, self.observed, self.floor, self.key_id, records))
        except UnicodeEncodeError:   # a string no door should have let in: the rest is still saved
            kept = [r for r in records if encodes(r)]
            log.warning("top-users: %d users with text that is not UTF-8 left out of the saved sketch",
                        len(records) - len(kept))
            data = msgspec.msgpack.encode(SavedSketch(FORMAT, self.observed, self.floor, self.key_id, kept))
        path = Path(path)
        partial = path.with_name(path.name + ".partial")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as file:   # (a plain os.write may write only part of a large sketch)
            os.fchmod(fd, 0o600)   # an older file of the same name may have been more open
            file.write(data)
            file.flush()
            os.fsync(fd)
        try:
            os.replace(partial, path)
        except OSError:   # (a directory in the file's place): no temporary file left at each attempt
            partial.unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike, users: int = 50_000, inputs_per_user: int = 4,
             **options: Any) -> "TopUsers":
        """The sketch saved at `path` (`options`: the constructor's pseudonym, retain_days, clock),
        less what is past its retention; an empty one if there is none or it cannot be read
        (logged, without its content)."""
        sketch = cls(users, inputs_per_user, **options)
        try:
            raw = Path(path).read_bytes()
            version = msgspec.msgpack.decode(raw, type=Format).format
            saved = msgspec.msgpack.decode(raw, type=FirstFormat if version == 1 else SavedSketch)
        except FileNotFoundError:
            _read_fine(path)
            return sketch
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            _warn_once(path, type(exc).__name__, "top-users file %s is unreadable (%s); starting a new one",
                       path, type(exc).__name__)
            return sketch
        # Counts past 2**53 (no real traffic reaches them) would overflow msgpack's 64 bits as they
        # grow, and every later save would fail: refuse them here, where the file is read.
        counts = [saved.observed, saved.floor, *(n for u in saved.users for n in (
            (u.count, u.error, u.last_seen, *(i[2] for i in u.inputs), *(i[3] for i in u.inputs))
            if isinstance(u, UserRecord) else (u[2], u[3], *(i[2] for i in u[4]))))]
        if not all(0 <= n <= 2**53 for n in counts):
            _warn_once(path, "counts", "top-users file %s holds a count outside 0 to 2**53; starting a new one", path)
            return sketch
        if isinstance(saved, FirstFormat):
            _read_fine(path)
            return sketch._converted(saved, path)
        if saved.format != FORMAT:
            _warn_once(path, f"format {saved.format}", "top-users file %s has format %s, not %s; starting a new one",
                       path, saved.format, FORMAT)
            return sketch
        if saved.key_id != sketch.key_id and sketch.pseudonym is not plain:
            if saved.key_id:   # hashed under another key: nobody could erase these users by name
                _warn_once(path, "key", "top-users file %s was hashed with another user-id key; starting a new one",
                           path)
                return sketch
            rename = sketch.pseudonym   # saved with plain ids (a tool's): hashed now
        else:
            rename = plain
        _read_fine(path)
        sketch.observed, sketch.floor = saved.observed, saved.floor
        sketch._users = {(r.tenant, rename(r.user)): [r.count, r.error, r.last_seen,
                                                       {(m, x): [k, at] for m, x, k, at in r.inputs}
                                                       if inputs_per_user else {}]
                         for r in saved.users}
        sketch._settle(users)
        sketch._cut_to_bounds()
        return sketch

    def _cut_to_bounds(self) -> None:
        """Drop the texts a loaded file holds beyond this sketch's byte bounds (saved under larger
        ones, or before there were any)."""
        for entry in self._users.values():
            inputs = entry[3]
            for asked in [asked for asked in inputs if self._kept_size(asked[1]) is None]:
                del inputs[asked]
        self._fit_texts(self.text_budget)

    def _converted(self, saved: FirstFormat, path: str | os.PathLike) -> "TopUsers":
        """A first-format file: ids hashed, counts kept as seen now, every text dropped (no date)."""
        now = int(self.clock())
        self.observed, self.floor = saved.observed, saved.floor
        for tenant, user, count, error, _ in saved.users:
            self._users[(tenant, self.pseudonym(user))] = [count, error, now, {}]
        log.info("top-users file %s converted from format %d: user ids hashed, %d users kept, their input "
                 "texts dropped (their age is unknown)", path, saved.format, len(self._users))
        self._settle(self.limit)
        return self

    def _settle(self, users: int) -> None:
        self.expire()
        if len(self._users) > users:
            self._prune()
