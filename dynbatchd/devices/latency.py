"""The latency formula of a simulated accelerator, shared by the live `simulated` runner and the
simulator (`dynbatchd.simulate`), so that neither layer imports the other.

A batch of `n` requests carrying `tokens` tokens takes
``base_ms + per_item_ms·n + per_token_ms·tokens``; past a memory limit
(`memory_items`, `memory_tokens`) it raises OutOfMemory after wasting `oom_ms`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from dynbatchd.devices.execution import OutOfMemory

MS = 1_000_000


@dataclass(frozen=True, slots=True)
class DeviceModel:
    base_ms: float = 8.0
    per_item_ms: float = 0.5
    per_token_ms: float = 0.0
    memory_items: int = 0      # a batch of more items raises OOM (0: no limit)
    memory_tokens: int = 0     # a batch of more tokens raises OOM (0: no limit)
    oom_ms: float = 0.0        # device time a failed (OOM) attempt wastes

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "DeviceModel":
        """The options of ``[models.X] runner = "simulated"`` (unknown ones are the config's to refuse)."""
        kw = {f.name: f.type for f in fields(cls)}
        return cls(**{k: (int if kw[k] == "int" else float)(v) for k, v in options.items() if k in kw})

    def options(self) -> dict[str, Any]:
        """Options for a live ``simulated`` runner with this model (limits only where set)."""
        out: dict[str, Any] = {"base_ms": self.base_ms, "per_item_ms": self.per_item_ms,
                               "per_token_ms": self.per_token_ms}
        for key in ("memory_items", "memory_tokens", "oom_ms"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        return out

    def latency_ns(self, size: int, tokens: int) -> int:
        return round((self.base_ms + self.per_item_ms * size + self.per_token_ms * tokens) * MS)

    def fits(self, size: int, tokens: int) -> bool:
        return not ((self.memory_items and size > self.memory_items)
                    or (self.memory_tokens and tokens > self.memory_tokens))

    def memory_fraction(self, size: int, tokens: int) -> float:
        """How full a batch of this shape makes the device (0 when there is no limit)."""
        parts = []
        if self.memory_items:
            parts.append(size / self.memory_items)
        if self.memory_tokens:
            parts.append(tokens / self.memory_tokens)
        return max(parts, default=0.0)

    def capacity_rps(self, batch: int, tokens_per_item: float = 0.0) -> float:
        """Requests per second one device sustains with full batches of `batch`."""
        return batch * 1e9 / self.latency_ns(batch, round(batch * tokens_per_item))

    def attempt_ns(self, size: int, tokens: int) -> int:
        """Device time one attempt takes; raises OutOfMemory (after `oom_ms`) when it cannot fit."""
        if not self.fits(size, tokens):
            raise OutOfMemory(f"simulated device memory exceeded by {size} items / {tokens} tokens")
        return self.latency_ns(size, tokens)
