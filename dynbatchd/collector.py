"""Garbage-collector settings for the serving daemon.

The request path makes no reference cycles (tests/engine/test_engine.py checks it), so the
collector has little to find there, yet with CPython's defaults it ran about 250 times a
second at 20k requests/s and, with a backlog, every request's objects were still alive
and got promoted and walked again: about 5% of the daemon's time. So once start-up is
done its objects (modules, config, plugins) are frozen out of the collector's passes, and
the youngest generation is collected every YOUNG_LIMIT new objects instead of every 700.
Cycles from rare paths are still collected, a little later.
"""

from __future__ import annotations

import gc

YOUNG_LIMIT = 20_000   # objects allocated between collections of the youngest generation


def settle_for_serving() -> None:
    """Call once the daemon serves: freeze start-up's objects, collect the young less often."""
    gc.freeze()
    gc.set_threshold(YOUNG_LIMIT, *gc.get_threshold()[1:])
