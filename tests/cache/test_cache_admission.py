"""The result cache's admission (W-TinyLFU) and bounds, deterministic: no clock, no daemon."""

from __future__ import annotations

import random

from dynbatchd.cache import AGAIN, ALWAYS, NEVER, FrequencySketch, ResultCache, entry_bytes

HOT = [("m", None, f"hot {i}") for i in range(50)]


def value(n_bytes: int = 16):
    return ({"dtype": "float32"}, b"x" * n_bytes)


def ask(cache: ResultCache, key, store: str = "filter") -> None:
    if cache.get(key) is None:
        cache.put(key, value(), store)


def sales_peak(cache: ResultCache, store: str = "filter") -> None:
    """The hot set asked every round, between floods of keys asked once each (4 per hot ask)."""
    one_off = 0
    for _ in range(100):
        for key in HOT:
            ask(cache, key, store)
            for _ in range(4):
                ask(cache, ("m", None, f"one-off {one_off}"), store)
                one_off += 1


def test_a_flood_of_one_off_keys_cannot_evict_the_hot_set():
    cache = ResultCache(100)
    sales_peak(cache)
    assert sum(key in cache for key in HOT) >= 48
    assert cache.refused > 19_000
    assert cache.hits >= 0.95 * 100 * len(HOT) - len(HOT)


def test_a_plain_lru_loses_the_hot_set_to_the_same_flood():
    """The same stream with every result kept (`always`, the lru policy): the yardstick above."""
    cache = ResultCache(100)
    sales_peak(cache, ALWAYS)
    assert sum(key in cache for key in HOT) < 25
    assert cache.hits < 0.5 * 100 * len(HOT)


def test_the_byte_bound_holds_whatever_the_sizes():
    rng = random.Random(1)
    cache = ResultCache(10_000, max_bytes=50_000)
    for i in range(5_000):
        key = ("m", None, f"k{rng.randrange(2_000)}")
        if cache.get(key) is None:
            cache.put(key, value(rng.randrange(10, 2_000)), rng.choice(["filter", ALWAYS, AGAIN]))
        assert cache.bytes <= 50_000
    assert cache.bytes == sum(entry_bytes(k, v) for space in (cache._window, cache._main)
                              for k, (v, _) in space.items())
    assert cache.evictions > 0


def test_an_entry_larger_than_the_byte_bound_is_refused():
    cache = ResultCache(10, max_bytes=100)
    cache.put(("m", None, "big"), value(1_000), ALWAYS)
    assert ("m", None, "big") not in cache and cache.refused == 1 and cache.bytes == 0


def test_a_refresh_too_large_for_the_byte_bound_drops_the_stale_value():
    cache = ResultCache(10, max_bytes=100)
    key = ("m", None, "grows")
    cache.put(key, value(10), ALWAYS)
    cache.put(key, value(1_000), ALWAYS)        # the new result cannot be kept; the old one is stale
    assert key not in cache and cache.bytes == 0 and cache.refused == 1


def test_again_keeps_only_what_was_asked_before():
    cache = ResultCache(100)
    rare = ("m", None, "a rare user's one-off")
    assert cache.get(rare) is None
    cache.put(rare, value(), AGAIN)
    assert rare not in cache                 # asked once: not kept
    assert cache.get(rare) is None
    cache.put(rare, value(), AGAIN)
    assert rare in cache                     # asked a second time: kept


def test_never_keeps_nothing_and_always_refreshes_in_place():
    cache = ResultCache(100)
    cache.put(("m", None, "no"), value(), NEVER)
    assert len(cache) == 0
    key = ("m", None, "session")
    cache.put(key, value(16), ALWAYS)
    cache.put(key, value(32), ALWAYS)        # a refresh: the new value, the bytes follow
    assert len(cache) == 1 and cache.get(key)[1] == b"x" * 32
    assert cache.bytes == entry_bytes(key, value(32))


def test_snapshot_reports_what_metrics_export():
    cache = ResultCache(2)
    for i in range(5):
        cache.get(("m", None, str(i)))
        cache.put(("m", None, str(i)), value())
    snap = cache.snapshot()
    assert snap["entries"] <= 2
    assert {"hits", "misses", "evictions", "admissions_refused", "bytes", "max_bytes"} <= set(snap)
    assert snap["misses"] == 5


def test_a_small_caches_sketch_rarely_reads_a_newcomer_as_asked_before():
    """The `again` rule keeps an answer only once its key was asked before, by the sketch's count.
    A 3-entry cache that has seen 40 keys must not count a new key as seen (all four of its
    counters shared) more than rarely: 64 counters a row did so for 409 of these 10,000 newcomers
    (a live test's one-off was kept ~1 run in 100), the floor of 256 for 2. Keys are tuples of
    integers, as a cache key is a tuple, but with no string in it: their hash is the same on every
    run, so is the count."""
    sketch = FrequencySketch(3)
    for i in range(40):
        sketch.add((0, i))
    seen = sum(1 for i in range(1000, 11_000) if sketch.estimate((0, i)) >= 1)
    assert seen < 50   # < 0.5 % of 10,000 newcomers
