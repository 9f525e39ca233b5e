"""The KV cache as an admission budget: the planner's formula (`dynbatchd.memory`), live.

A sequence holds 2 × layers × kv_heads × head_dim × tokens × bytes of KV. The budget is what
`plan_memory` calls usable (device memory less 20% headroom, the weights and a workspace
reserve). A request is admitted only when its worst case (prompt + max_new_tokens) fits beside
the worst cases already admitted, so a running batch can never outgrow the cache; the ledger
counts every reservation and checks the sum against the budget each time (`over_budget` stays 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dynbatchd.memory import ModelDims, per_request_bytes, plan_memory


def kv_bytes_per_token(dims: ModelDims) -> int:
    """One token's KV, by the planner's own formula (a decoder's per-request bytes at seq_len 1)."""
    return per_request_bytes(replace(dims, seq_len=1, kind="decoder"))[0]


def kv_budget_tokens_of(path: str, total_bytes: int, *, name: str = "", dtype: str | None = None) -> int | None:
    """The KV budget in tokens of the decoder in directory `path` (its config.json) on a device of
    `total_bytes`, by the planner's formula; None where there is nothing to size it from. The
    daemon's worker (a CUDA device's memory) and the simulator (``[devices] memory_gb``) both ask here."""
    from pathlib import Path

    from dynbatchd.memory import model_dims, read_model_config

    if not total_bytes or not path or not (Path(path) / "config.json").is_file():
        return None
    hf, model_dir = read_model_config(path)
    dims = model_dims(hf, model_dir=model_dir, name=name, kind="decoder", dtype=dtype)
    return kv_budget_bytes(dims, total_bytes) // kv_bytes_per_token(dims)


def kv_budget_bytes(dims: ModelDims, total_bytes: int, *, headroom: float = 0.20,
                    reserve_bytes: int | None = None) -> int:
    """The bytes of KV a device may hold: `plan_memory`'s usable memory (after headroom, weights, reserve)."""
    return max(0, plan_memory(dims, total_bytes, headroom=headroom, reserve_bytes=reserve_bytes).usable_bytes)


@dataclass
class KVLedger:
    """Worst-case KV reserved per sequence, against a fixed budget; counts what it admits and refuses."""
    budget_bytes: int
    bytes_per_token: int
    reserved: dict[str, int] = field(default_factory=dict)
    in_use_bytes: int = 0
    peak_bytes: int = 0
    admitted: int = 0
    refused: int = 0
    released: int = 0
    over_budget: int = 0       # reservations that left the sum above the budget: must stay 0

    def need(self, tokens: int) -> int:
        return tokens * self.bytes_per_token

    def fits(self, tokens: int) -> bool:
        return self.in_use_bytes + self.need(tokens) <= self.budget_bytes

    def ever_fits(self, tokens: int) -> bool:
        """Whether `tokens` fit in an empty cache (else the request can never run)."""
        return self.need(tokens) <= self.budget_bytes

    def reserve(self, seq_id: str, tokens: int) -> bool:
        """Reserve a sequence's worst case if it fits; False (and counted as refused) if not."""
        if seq_id in self.reserved:
            raise ValueError(f"sequence {seq_id!r} already holds KV")
        if not self.fits(tokens):
            self.refused += 1
            return False
        self.reserved[seq_id] = self.need(tokens)
        self.in_use_bytes += self.reserved[seq_id]
        self.admitted += 1
        if self.in_use_bytes > self.budget_bytes:
            self.over_budget += 1
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)
        return True

    def release(self, seq_id: str) -> int:
        """Free a sequence's KV at once (finished, cancelled, expired or preempted); bytes freed."""
        freed = self.reserved.pop(seq_id, 0)
        if freed:
            self.in_use_bytes -= freed
            self.released += 1
        return freed

    def counters(self) -> dict[str, int]:
        return {"kv_budget_bytes": self.budget_bytes, "kv_in_use_bytes": self.in_use_bytes,
                "kv_peak_bytes": self.peak_bytes, "kv_admitted": self.admitted, "kv_refused": self.refused,
                "kv_released": self.released, "kv_over_budget": self.over_budget}
