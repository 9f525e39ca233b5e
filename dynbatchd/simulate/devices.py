"""One latency model of an accelerator, for the live `simulated` runner and the simulator alike.

A batch of `n` requests carrying `tokens` tokens takes
``base_ms + per_item_ms·n + per_token_ms·tokens``; past a memory limit
(`memory_items`, `memory_tokens`) it raises OutOfMemory after wasting
`oom_ms`. The live runner sleeps that long; the simulator's `VirtualRunner`
only adds it up, and both go through the worker's own `execute` (the same
bisection of a failing batch). Every figure it produces is SIMULATED.
"""

from __future__ import annotations

from typing import Any

from dynbatchd.devices.execution import Execution, OutOfMemory, execute
from dynbatchd.devices.latency import MS, DeviceModel  # the formula lives beside the live runner

__all__ = ["MS", "DeviceModel", "VirtualRunner"]


class VirtualRunner:
    """The simulated runner without the sleeping: `run` adds each attempt's time to `spent_ns`."""

    simulated = True

    def __init__(self, model: DeviceModel):
        self.model = model
        self.spent_ns = 0

    def check(self, item: Any) -> str | None:
        return None

    def run(self, inputs: list[Any], tokens: list[int]) -> list[Any]:
        try:
            self.spent_ns += self.model.attempt_ns(len(inputs), sum(tokens))
        except OutOfMemory:
            self.spent_ns += round(self.model.oom_ms * MS)
            raise
        return [None] * len(inputs)

    def execute(self, tokens: list[int]) -> tuple[Execution, int]:
        """Run one batch as the worker would: its outcome, and the device time it took."""
        self.spent_ns = 0
        run = execute(self, [None] * len(tokens), tokens, "simulated")
        return run, self.spent_ns
