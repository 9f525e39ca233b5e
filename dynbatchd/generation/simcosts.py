"""The ``simulated`` option of a causal-lm model: the step costs `dynbatchctl simulate`, `capacity`
and `tune` give its simulated device (`dynbatchd.generation.simulation.GenerationLatency`'s fields).

A module of its own that imports nothing of ours, so the runner's option table can check the
option without importing the simulator. The live runner ignores it.
"""

from __future__ import annotations

import math
from typing import Any

COST_KEYS = ("step_ms", "per_seq_ms", "per_kv_token_ms", "prefill_ms_per_token")


def simulated_costs(value: Any) -> str | None:
    """Checker: a table of COST_KEYS, each a finite number >= 0 (a key left out keeps its default)."""
    if not isinstance(value, dict):
        return f"expected a table of {', '.join(COST_KEYS)}, got {value!r}"
    for key, cost in value.items():
        if key not in COST_KEYS:
            return f"unknown cost {key!r} (known: {', '.join(COST_KEYS)})"
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not math.isfinite(cost) or cost < 0:
            return f"{key}: expected a number >= 0, got {cost!r}"
    return None
