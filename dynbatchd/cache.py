"""A result cache that admits by frequency, bounded in entries and in bytes.

The e-commerce case: during a sales peak, one-off users filled a plain LRU
cache and pushed out what the daily users asked again, so the GPU recomputed
it. This cache is W-TinyLFU (Einziger, Friedman & Manes, 2017): a new result
enters a small window (1 % of the space, so a burst of new keys still gets a
chance); what the window pushes out enters the main space only if a
count-min sketch says its key has been asked more often than the main
space's least recently used entry, which it would replace. One-off keys lose
that comparison and cannot evict what is asked again.

Why our own store and not `theine` or `cachebox`: theine's W-TinyLFU core
(`theine_core.TlfuCore`) bounds entries only and picks its victims itself,
so a byte bound cannot be enforced on it; cachebox has no frequency
admission. The store and the sketch here are ~150 lines of dicts.

How a result is stored is the caller's `store` mode, which the cache-policy
hook decides per request (`dynbatchd.hookspecs.CacheRule`): ``filter`` (the
frequency admission above), ``always`` (straight into the main space, the
least recently used goes: a session refresh, a warmup input, or a plain LRU),
``again`` (only a key asked before: a rare user's one-off is never kept) or
``never``.

The daemon keys entries by (model, tenant, text), the tenant None for
requests without one, so one tenant's result never answers another tenant's
request, and warmup inputs of no tenant serve only requests without one. It
keeps what `dynbatchd.daemon_batches.freeze` makes of an output: (tensor
descriptor, bytes) or (plain value, None). Nothing from an isolated channel
is cached.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Hashable

FILTER, ALWAYS, AGAIN, NEVER = "filter", "always", "again", "never"
STORE_MODES = (FILTER, ALWAYS, AGAIN, NEVER)
WINDOW_SHARE = 0.01          # the admission window's share of the bounds
PLAIN_VALUE_BYTES = 64       # what a small msgpack value is counted as
_MASK64 = (1 << 64) - 1
_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)


def entry_bytes(key: Hashable, value: Any) -> int:
    """The bytes an entry holds: its output's raw bytes (or a small value) and its input text."""
    text = key[-1] if isinstance(key, tuple) and key and isinstance(key[-1], str) else ""
    data = value[1] if isinstance(value, tuple) and len(value) == 2 else None
    return len(text) + (len(data) if isinstance(data, (bytes, bytearray, memoryview)) else PLAIN_VALUE_BYTES)


class FrequencySketch:
    """How often each key was asked, approximately: a count-min sketch of 4 rows of 4-bit
    counters, halved every 10 × width additions so that old popularity fades. A row has at least
    MIN_WIDTH counters: with fewer, a small cache's keys share all four of a newcomer's counters
    often enough (4 in 100 first asks with 3 entries and 64 counters) to read it as asked before, and
    the ``again`` rule keeps a one-off."""

    __slots__ = ("_counts", "_mask", "_width", "_added", "_reset_at")

    MIN_WIDTH = 256

    def __init__(self, expected_keys: int):
        width = self.MIN_WIDTH
        while width < 4 * expected_keys:
            width <<= 1
        self._width, self._mask = width, width - 1
        self._counts = [0] * (4 * width)
        self._added, self._reset_at = 0, 10 * width

    def _slots(self, key: Hashable) -> list[int]:
        h, w, m = hash(key) & _MASK64, self._width, self._mask
        return [row * w + ((((h ^ seed) * 0xFF51AFD7ED558CCD) & _MASK64) >> 40 & m)
                for row, seed in enumerate(_SEEDS)]

    def add(self, key: Hashable) -> None:
        counts = self._counts
        for slot in self._slots(key):
            if counts[slot] < 15:
                counts[slot] += 1
        self._added += 1
        if self._added >= self._reset_at:
            self._counts = [c >> 1 for c in counts]
            self._added //= 2

    def estimate(self, key: Hashable) -> int:
        counts = self._counts
        return min(counts[slot] for slot in self._slots(key))


class ResultCache:
    def __init__(self, entries: int, max_bytes: int = 0, *,
                 sizeof: Callable[[Hashable, Any], int] = entry_bytes):
        self.capacity = entries
        self.max_bytes = max_bytes             # 0: bounded in entries only
        self.sizeof = sizeof
        self.sketch = FrequencySketch(entries)
        self._window: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._main: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._window_entries = max(1, int(entries * WINDOW_SHARE))
        self._window_bytes = int(max_bytes * WINDOW_SHARE)
        self.bytes = self._bytes_window = 0
        self.hits = self.misses = self.evictions = self.refused = 0

    def __len__(self) -> int:
        return len(self._window) + len(self._main)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._main or key in self._window

    def get(self, key: Hashable) -> Any:
        """The cached output for `key`, or None; every lookup counts towards its frequency."""
        self.sketch.add(key)
        entry = self._main.get(key)
        if entry is not None:
            self._main.move_to_end(key)
        else:
            entry = self._window.get(key)
            if entry is not None:
                self._window.move_to_end(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        return entry[0]

    def put(self, key: Hashable, output: Any, store: str = FILTER) -> None:
        """Keep `output` for `key` as `store` says (see the module docstring)."""
        if store == NEVER:
            return
        size = self.sizeof(key, output)
        if self.max_bytes and size > self.max_bytes:   # never fits: refused, and a stale old value goes too
            self._drop(key)
            self.refused += 1
            return
        for space in (self._main, self._window):
            old = space.pop(key, None)
            if old is not None:   # a refresh: the new value, in the place of the old
                self.bytes += size - old[1]
                if space is self._window:
                    self._bytes_window += size - old[1]
                space[key] = (output, size)
                self._fit_total()
                return
        if store == AGAIN and self.sketch.estimate(key) < 2:
            self.refused += 1
            return
        self.bytes += size
        if store == ALWAYS:
            self._main[key] = (output, size)
            self._fit_total()
            return
        self._window[key] = (output, size)
        self._bytes_window += size
        while len(self._window) > self._window_entries or (self._window_bytes and self._bytes_window > self._window_bytes
                                                          and len(self._window) > 1):
            candidate, (value, csize) = self._window.popitem(last=False)
            self._bytes_window -= csize
            self._main[candidate] = (value, csize)   # on trial: it stays only if it beats the victims
            self._admit(candidate, csize)
        if self._over():   # one window entry larger than the window's byte share
            self._fit_total()

    def discard(self, key: Hashable) -> bool:
        """Erase the entry of `key` (`dynbatchctl forget`); whether there was one. Not an eviction."""
        if key not in self:
            return False
        self._drop(key)
        return True

    def discard_if(self, doomed: Callable[[Hashable], bool]) -> int:
        """Erase every entry whose key is `doomed` (a model a reload removed or added: its old
        answers are not the new model's); how many. Not evictions."""
        keys = [key for space in (self._main, self._window) for key in space if doomed(key)]
        for key in keys:
            self._drop(key)
        return len(keys)

    def _drop(self, key: Hashable) -> None:
        for space in (self._main, self._window):
            old = space.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
                if space is self._window:
                    self._bytes_window -= old[1]

    def _over(self) -> bool:
        return len(self) > self.capacity or bool(self.max_bytes and self.bytes > self.max_bytes)

    def _admit(self, candidate: Hashable, size: int) -> None:
        """`candidate` left the window for the main space: it replaces the least recently used
        entries only if asked more often than the first of them; else it is refused."""
        if not self._over():
            return
        victim = next(iter(self._main))
        if victim == candidate or self.sketch.estimate(candidate) <= self.sketch.estimate(victim):
            del self._main[candidate]
            self.bytes -= size
            self.refused += 1
            return
        self._fit_total()

    def _fit_total(self) -> None:
        """Evict least recently used entries (the main space first) until both bounds hold."""
        while self._over() and len(self) > 1:
            space = self._main if self._main else self._window
            _, (_, size) = space.popitem(last=False)
            self.bytes -= size
            if space is self._window:
                self._bytes_window -= size
            self.evictions += 1

    def snapshot(self) -> dict[str, Any]:
        looked = self.hits + self.misses
        return {"entries": len(self), "capacity": self.capacity, "bytes": self.bytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "admissions_refused": self.refused, "hit_rate": self.hits / looked if looked else 0.0}
