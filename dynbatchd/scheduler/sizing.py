"""Batch size: the memory model (how many requests fit) and the ``adaptive`` sizer.

Memory model (SPEC "Batch size"). For a decoder, each request holds a KV cache
of 2 (K and V) × layers × kv_heads × head_dim × seq_len × bytes_per_elem.
The weights are loaded once, whatever the batch size (the guide multiplies
them by the batch size, which is wrong). Usable memory is
total × (1 − headroom) − weights − reserve, and max batch =
floor(usable / per-request bytes). `plan_memory` returns every step of that
arithmetic as data, so `dynbatchctl plan` can show it.

Encoders (BERT-style models such as all-MiniLM-L6-v2) keep no KV cache: the
per-request term is the peak activation memory of one sequence inside one
layer (layers run one after another and, under inference mode, a layer's
activations are freed once the next has its input):
seq_len × (4 × hidden + intermediate) × bytes (the layer input, Q, K, V and
the feed-forward intermediate) + 2 × heads × seq_len² × bytes (attention
scores and probabilities, as materialised by eager attention).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dynbatchd.scheduler.policies import MS
from dynbatchd.scheduler.windows import Options

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "float16": 2, "half": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
               "float8": 1, "fp8": 1, "int8": 1, "float64": 8}
ENCODER_TYPES = {"bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "electra", "albert", "camembert",
                 "deberta", "deberta-v2", "ernie", "nomic_bert", "modernbert"}
DECODER_MARKERS = ("CausalLM", "LMHeadModel", "ForConditionalGeneration")


def fmt_bytes(n: float) -> str:
    """1.50 GiB, 86.66 MiB, 512 B: for formulas people read (JSON keeps exact bytes)."""
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def _first(cfg: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return None


@dataclass(frozen=True)
class ModelDims:
    """What the memory model needs from a model's config.json (and its weight files)."""
    name: str
    kind: str                  # "decoder" (KV cache) or "encoder" (activations)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    seq_len: int
    bytes_per_elem: int
    weights_bytes: int
    weights_from: str          # "safetensors", "bin" or "parameter estimate"
    source: str = ""


def read_model_config(path: str | Path) -> tuple[dict[str, Any], Path]:
    """A model directory or its config.json → (config dict, model directory)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(file.read_text())
    except OSError as exc:
        raise ValueError(f"{file}: cannot read the model config: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return cfg, file.parent


def weights_on_disk(model_dir: Path) -> tuple[int, str]:
    """Total size of the weight files (safetensors preferred), or (0, "") when there are none."""
    for pattern, kind in (("*.safetensors", "safetensors"), ("pytorch_model*.bin", "bin")):
        files = sorted(model_dir.glob(pattern))
        if files:
            return sum(f.stat().st_size for f in files), kind
    return 0, ""


def model_dims(cfg: dict[str, Any], *, model_dir: Path | None = None, name: str = "", seq_len: int | None = None,
               dtype: str | None = None, kind: str | None = None) -> ModelDims:
    """Dimensions from a Hugging Face config; weights from the files beside it, else estimated."""
    if _first(cfg, "num_hidden_layers", "n_layer", "num_layers") is None and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "architectures": cfg.get("architectures"), "torch_dtype": cfg.get("torch_dtype")}
    layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(cfg, "num_attention_heads", "n_head", "num_heads")
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    missing = [k for k, v in (("num_hidden_layers", layers), ("num_attention_heads", heads),
                              ("hidden_size", hidden)) if not v]
    if missing:
        raise ValueError(f"model config lacks {', '.join(missing)}")
    layers, heads, hidden = int(layers), int(heads), int(hidden)
    kv_heads = int(_first(cfg, "num_key_value_heads", "n_kv_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    intermediate = int(_first(cfg, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden)
    positions = _first(cfg, "max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
    if seq_len is None:
        if not positions:
            raise ValueError("model config has no max_position_embeddings: give a sequence length")
        seq_len = int(positions)
    if seq_len < 1:
        raise ValueError(f"sequence length must be >= 1, got {seq_len}")
    dtype = dtype or str(cfg.get("torch_dtype") or "float32")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(sorted(DTYPE_BYTES))})")
    nbytes = DTYPE_BYTES[dtype]
    if kind is None:
        archs = cfg.get("architectures") or []
        decoder = cfg.get("is_decoder") or any(m in a for a in archs for m in DECODER_MARKERS)
        kind = "encoder" if not decoder and cfg.get("model_type") in ENCODER_TYPES else "decoder"
    weights, weights_from = weights_on_disk(model_dir) if model_dir else (0, "")
    if not weights:
        vocab = int(cfg.get("vocab_size") or 0)
        # Per layer: attention (Q, O full; K, V at kv width) + a gated or plain MLP; plus embeddings.
        mlp = (3 if cfg.get("hidden_act") in ("silu", "swiglu") else 2) * hidden * intermediate
        attn = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim
        weights, weights_from = (layers * (attn + mlp) + vocab * hidden) * nbytes, "parameter estimate"
    return ModelDims(name or str(cfg.get("_name_or_path") or cfg.get("model_type") or "model"), kind, layers, heads,
                     kv_heads, head_dim, hidden, intermediate, seq_len, nbytes, weights, weights_from,
                     str(model_dir or ""))


@dataclass(frozen=True)
class Step:
    label: str
    formula: str
    value: float
    unit: str = "bytes"


@dataclass(frozen=True)
class MemoryPlan:
    dims: ModelDims
    total_bytes: int
    headroom: float
    reserve_bytes: int
    per_request_bytes: int
    usable_bytes: int
    max_batch: int
    guide_max_batch: int        # what the guide's formula (weights × batch) would allow, for comparison
    steps: list[Step] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def per_request_bytes(d: ModelDims) -> tuple[int, str]:
    """Bytes one request needs during a batch, and the formula with the numbers filled in."""
    b, s = d.bytes_per_elem, d.seq_len
    if d.kind == "encoder":
        act = s * (4 * d.hidden + d.intermediate) * b + 2 * d.heads * s * s * b
        return act, (f"{s} tokens × (4 × {d.hidden} hidden + {d.intermediate} intermediate) × {b} B"
                     f" + 2 × {d.heads} heads × {s}² × {b} B (encoder activations)")
    kv = 2 * d.layers * d.kv_heads * d.head_dim * s * b
    return kv, f"2 × {d.layers} layers × {d.kv_heads} kv_heads × {d.head_dim} head_dim × {s} tokens × {b} B"


def plan_memory(dims: ModelDims, total_bytes: int, *, headroom: float = 0.20, reserve_bytes: int | None = None) -> MemoryPlan:
    """The max batch that fits, with every step of the arithmetic.

    `reserve_bytes` is the activation/workspace reserve (CUDA context, cuBLAS
    workspace, allocator slack); default min(1 GiB, 5% of total).
    """
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"headroom must be in [0, 1), got {headroom:g}")
    if reserve_bytes is None:
        reserve_bytes = min(GIB, int(total_bytes * 0.05))
    per_req, formula = per_request_bytes(dims)
    budget = int(total_bytes * (1.0 - headroom))
    usable = budget - dims.weights_bytes - reserve_bytes
    max_batch = max(0, usable // per_req) if per_req > 0 else 0
    guide = max(0, (budget - reserve_bytes) // (dims.weights_bytes + per_req))
    f = fmt_bytes
    steps = [
        Step("device memory", "total", total_bytes),
        Step("after headroom", f"{f(total_bytes)} × (1 − {headroom:g})", budget),
        Step("weights (once)", f"from {dims.weights_from}, not × batch", dims.weights_bytes),
        Step("workspace reserve", "activations / workspace", reserve_bytes),
        Step("usable", f"{f(budget)} − {f(dims.weights_bytes)} − {f(reserve_bytes)}", usable),
        Step("per request", formula, per_req),
        Step("max batch", f"floor({f(usable)} / {f(per_req)})", max_batch, "requests"),
    ]
    return MemoryPlan(dims, total_bytes, headroom, reserve_bytes, per_req, usable, int(max_batch), int(guide), steps)


# ---------------------------------------------------------------------------
# adaptive sizer
# ---------------------------------------------------------------------------

def _scaled(limit: int, factor: float, up: bool) -> int:
    x = round(limit * factor, 9)  # 5 × 1.2 is 6.000000000000001 in floating point
    return math.ceil(x) if up else math.floor(x)


class AdaptiveSizer:
    """The guide's rule with hysteresis.

    Each ``observe(utilisation=, memory=, queue_len=, now_ns=)`` (fractions
    0..1 of device busy time and memory in use; the channel's queue length)
    votes:
    - shrink when utilisation > ``high_util`` (0.90) or memory > ``high_memory`` (0.80);
    - grow when utilisation < ``low_util`` (0.70) and queue_len > ``queue_above`` (10);
    - hold otherwise (the dead band 0.70..0.90 holds, whatever the queue).
    The limit changes only after ``patience`` (3) consecutive identical votes
    and at least ``cooldown_ms`` (1000) after the previous change; a hold or
    an opposite vote resets the count, so alternating signals never move it.
    Shrink: × ``shrink`` (0.8), rounded down, at least 1. Grow: × ``grow``
    (1.2), rounded up (so 1 → 2), at most the ceiling.

    The ceiling starts at ``max_batch`` (default the channel's max_batch).
    ``on_oom(failed_size)`` lowers both the limit and the ceiling below the
    failed size (to min(limit, failed − 1, floor(failed × shrink)), at least
    1), at once and without waiting for hysteresis, so growth never returns
    to a size that did not fit. Start: ``start`` (default the ceiling).
    """

    def __init__(self, max_batch: int, *, start: int | None = None, high_util: float = 0.90,
                 high_memory: float = 0.80, low_util: float = 0.70, queue_above: int = 10, shrink: float = 0.8,
                 grow: float = 1.2, patience: int = 3, cooldown_ms: float = 1000.0):
        self.ceiling = max_batch
        self.limit = min(max_batch, start or max_batch)
        self.high_util, self.high_memory, self.low_util = high_util, high_memory, low_util
        self.queue_above = queue_above
        self.shrink, self.grow = shrink, grow
        self.patience = patience
        self.cooldown_ns = int(cooldown_ms * MS)
        self._vote = "hold"
        self._streak = 0
        self._changed_ns: int | None = None
        self.changes = 0
        self.last_change = ""

    @classmethod
    def factory(cls, channel: str, settings: Any, options: dict[str, Any]) -> "AdaptiveSizer":
        where = f"channels.{channel}.batch_size.options"
        o = Options(where, options, {"max_batch", "start", "high_util", "high_memory", "low_util", "queue_above",
                                     "shrink", "grow", "patience", "cooldown_ms"})
        max_batch = o.count("max_batch", int(settings.max_batch))
        kw = dict(high_util=o.num("high_util", 0.90, lo=0.0, hi=1.0), high_memory=o.num("high_memory", 0.80, lo=0.0, hi=1.0),
                  low_util=o.num("low_util", 0.70, lo=0.0, hi=1.0), queue_above=o.count("queue_above", 10, lo=0),
                  shrink=o.num("shrink", 0.8, lo=0.0, hi=1.0, lo_open=True), grow=o.num("grow", 1.2, lo=1.0),
                  patience=o.count("patience", 3), cooldown_ms=o.num("cooldown_ms", 1000.0, lo=0.0))
        if kw["low_util"] >= kw["high_util"]:
            raise ValueError(f"{where}.low_util: {kw['low_util']:g} must be below high_util {kw['high_util']:g}")
        start = o.count("start", max_batch) if "start" in options else None
        return cls(max_batch, start=start, **kw)

    def max_batch(self) -> int:
        return self.limit

    def vote(self, utilisation: float, memory: float, queue_len: int) -> str:
        if utilisation > self.high_util or memory > self.high_memory:
            return "shrink"
        if utilisation < self.low_util and queue_len > self.queue_above:
            return "grow"
        return "hold"

    def observe(self, *, utilisation: float, memory: float, queue_len: int, now_ns: int) -> None:
        vote = self.vote(utilisation, memory, queue_len)
        self._streak = self._streak + 1 if vote == self._vote else 1
        self._vote = vote
        if vote == "hold" or self._streak < self.patience:
            return
        if self._changed_ns is not None and now_ns - self._changed_ns < self.cooldown_ns:
            return
        if vote == "shrink":
            new = max(1, _scaled(self.limit, self.shrink, up=False))
        else:
            new = min(self.ceiling, max(self.limit, _scaled(self.limit, self.grow, up=True)))
        if new != self.limit:
            self.limit = new
            self.changes += 1
            self.last_change = vote
            self._changed_ns = now_ns
        self._streak = 0

    def on_oom(self, failed_size: int) -> None:
        below = max(1, min(failed_size - 1, _scaled(failed_size, self.shrink, up=False)))
        self.ceiling = max(1, min(self.ceiling, below))
        if self.limit > below:
            self.limit = below
            self.changes += 1
            self.last_change = "oom"

    def inherit(self, previous: "AdaptiveSizer") -> None:
        """Retuned: keep the ceiling an out-of-memory lowered, and the size reached so far."""
        self.ceiling = min(self.ceiling, previous.ceiling)
        self.limit = max(1, min(self.ceiling, previous.limit))
        self.changes, self.last_change, self._changed_ns = previous.changes, previous.last_change, previous._changed_ns

    def describe(self) -> dict[str, Any]:
        return {"policy": "adaptive", "max_batch": self.limit, "ceiling": self.ceiling,
                "last_change": self.last_change, "changes": self.changes}


def factories() -> dict[str, Any]:
    """Name → factory, for the built-in sizing plugin."""
    return {"adaptive": AdaptiveSizer.factory}
