"""Checked access to a policy's options table, shared by every window and batch-size policy."""

from __future__ import annotations

import math
from typing import Any

from dynbatchd.errors import OptionError

MAX_ENTRIES = 64   # of a policy's list option (bandit's windows and caps, tiered's tiers): a few arms or tiers


def check_entries(value: Any, where: str) -> None:
    """Refuse a list option of more than MAX_ENTRIES entries, before anything iterates over it: a
    policy built from thousands (x thousands, for the bandit's arms) held the event loop at reload."""
    if isinstance(value, (list, tuple)) and len(value) > MAX_ENTRIES:
        raise OptionError(where, f"at most {MAX_ENTRIES} entries, got {len(value)}")


class Options:
    """Checked access to one policy's options table; leftovers are errors."""

    def __init__(self, where: str, options: dict[str, Any], known: set[str]):
        self.where = where
        self.options = options
        unknown = sorted(set(options) - known)
        if unknown:
            raise OptionError(where, f"unknown option {unknown[0]!r} (known: {', '.join(sorted(known))})")

    def num(self, key: str, default: float, *, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False) -> float:
        value = self.options.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise OptionError(f"{self.where}.{key}", f"expected a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):   # (an adaptive sizer's grow = inf raised in the device observer, killing the watchdog)
            raise OptionError(f"{self.where}.{key}", f"must be a finite number, got {value!r}")
        if lo is not None and (value < lo or (lo_open and value == lo)):
            raise OptionError(f"{self.where}.{key}", f"must be {'>' if lo_open else '>='} {lo:g}, got {value:g}")
        if hi is not None and value > hi:
            raise OptionError(f"{self.where}.{key}", f"must be <= {hi:g}, got {value:g}")
        return value

    def count(self, key: str, default: int, *, lo: int = 1) -> int:
        value = self.options.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise OptionError(f"{self.where}.{key}", f"expected an integer >= {lo}, got {value!r}")
        return value
