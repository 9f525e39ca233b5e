"""The offline memory planner: how many requests of a model fit on one device.

It reads model files (config.json, weights) from disk, so it lives outside the
pure scheduler package; `dynbatchctl plan` shows its arithmetic.

Memory model (SPEC "Batch size"). For a decoder, each request holds a KV cache
of 2 (K and V) × layers × kv_heads × head_dim × seq_len × bytes_per_elem.
The weights are loaded once, whatever the batch size (the guide multiplies
them by the batch size, which is wrong). Usable memory is
total × (1 − headroom) − weights − reserve, and max batch =
floor(usable / per-request bytes). `plan_memory` returns every step of that
arithmetic as data, so `dynbatchctl plan` can show it.

`device_limits` turns the same arithmetic into the live daemon's per-device
batch limits (a mixed pool's devices each get a batch they hold).

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
from typing import Any, NamedTuple

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


# Past any real model's dimension, and small enough that the plan's arithmetic (its float steps
# included) stays finite: a config.json's 1e400 or -32 is refused naming its key.
MOST_DIM = 2**31 - 1


def _dim(cfg: dict[str, Any], keys: tuple[str, ...], where: str) -> int | None:
    """The first of `keys` that `cfg` sets (not null), as a positive integer; None when none is set."""
    for key in keys:
        value = cfg.get(key)
        if value is None:
            continue
        whole = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value.is_integer())
        if isinstance(value, bool) or not whole or not 1 <= value <= MOST_DIM:
            raise ValueError(f"{where}: {key} must be a positive integer (at most {MOST_DIM}), got {value!r}")
        return int(value)
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
    where = f"model config in {model_dir}" if model_dir else "model config"
    dim = lambda *keys: _dim(cfg, keys, where)   # noqa: E731
    layers = dim("num_hidden_layers", "n_layer", "num_layers")
    heads = dim("num_attention_heads", "n_head", "num_heads")
    hidden = dim("hidden_size", "n_embd", "d_model")
    missing = [k for k, v in (("num_hidden_layers", layers), ("num_attention_heads", heads),
                              ("hidden_size", hidden)) if not v]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}")
    kv_heads = dim("num_key_value_heads", "n_kv_heads") or heads
    head_dim = dim("head_dim") or hidden // heads
    intermediate = dim("intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    positions = dim("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
    if seq_len is None:
        if not positions:
            raise ValueError(f"{where} has no max_position_embeddings: give a sequence length")
        seq_len = positions
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
        vocab = dim("vocab_size") or 0
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
# per-device batch limits for the live daemon
# ---------------------------------------------------------------------------
class DeviceLimit(NamedTuple):
    """The most items / tokens one batch may carry on a device (0: no limit), and where that came from
    (what `Engine(device_limits=...)` takes)."""
    items: int = 0
    tokens: int = 0
    source: str = ""           # "config", "NVML", "runner" ("" where nothing is known)


def model_directory(runner: Any, options: dict[str, Any]) -> tuple[Path, int | None] | None:
    """(model directory, sequence cap) the runner class `runner` plans from (its
    ``model_directory``: built-in and third-party runners alike), or None: no config.json to plan
    from (a program file, a callable without ``path``, a simulated device)."""
    found = runner.model_directory(options) if hasattr(runner, "model_directory") else None
    return None if found is None else (Path(found[0]), found[1])


def device_memory_bytes(settings: Any, device: str, probe: Any = None) -> tuple[int, str]:
    """(total bytes, source) of `device`: ``[devices] memory_gb`` for it, else NVML's total for a
    CUDA device, else (0, "") — unknown."""
    configured = settings.memory_gb_of(device)
    if configured > 0:
        return int(configured * GIB), "config"
    reading = probe.sample(device) if probe is not None and device.startswith("cuda:") else None
    if reading is not None and reading.memory_total_bytes:
        return int(reading.memory_total_bytes), "NVML"
    return 0, ""


def model_limit(runner: Any, options: dict[str, Any], device: str, total_bytes: int, source: str) -> DeviceLimit:
    """One model's batch limit on `device`: the runner class's own (`own_limit`: a simulated
    device's memory_items / memory_tokens), or the planner's max batch (`plan_memory`, as
    ``dynbatchctl plan``) for the config.json of its `model_directory`. `runner`: the class."""
    own = runner.own_limit(options, device) if hasattr(runner, "own_limit") else None
    if own is not None:
        items, tokens = own
        return DeviceLimit(items, tokens, "runner" if items or tokens else "")
    found = model_directory(runner, options) if total_bytes else None
    if found is None:
        return DeviceLimit()
    path, cap = found
    try:
        raw, model_dir = read_model_config(path)
        mp = plan_memory(model_dims(raw, model_dir=model_dir, seq_len=cap), total_bytes)
    except ValueError:
        return DeviceLimit()   # a model the planner cannot read runs unlimited, as before
    per_token = mp.per_request_bytes / mp.dims.seq_len if mp.dims.kind == "decoder" else 0.0
    tokens = int(mp.usable_bytes // per_token) if per_token > 0 and mp.usable_bytes > 0 else 0
    return DeviceLimit(max(1, mp.max_batch), tokens, source)


def device_limits(config: Any, devices: list[str], runners: dict[str, Any], probe: Any = None) -> list[DeviceLimit]:
    """Each device's batch limit for the engine (`Engine(device_limits=...)`): with several models,
    the tightest model's (an engine limit is per device, whatever the model), and its source.
    `runners`: the runner classes by name (``Plugins.runners()``), which say what to plan from."""
    out = []
    for device in devices:
        total, source = device_memory_bytes(config.devices, device, probe)
        limits = [model_limit(runners.get(m.runner), dict(m.options), device, total, source)
                  for m in config.models.values()]
        items = min((lim for lim in limits if lim.items), default=None, key=lambda lim: lim.items)
        tokens = min((lim for lim in limits if lim.tokens), default=None, key=lambda lim: lim.tokens)
        out.append(DeviceLimit(items.items if items else 0, tokens.tokens if tokens else 0,
                               (items or tokens or DeviceLimit()).source))
    return out


# ---------------------------------------------------------------------------
# what the daemon's own batches hold, for the adaptive sizer
# ---------------------------------------------------------------------------
def batch_peak_bytes(device: str) -> int:
    """Torch's peak *allocated* bytes on a CUDA `device` since the last call (the worker calls it once
    per batch, so it is that batch's peak: the weights plus what the batch needed), then resets the
    peak. Not the reserved bytes (torch's allocator keeps freed blocks cached) and not NVML's "used"
    (every process's, cache included): neither falls when batches shrink, so a sizer fed them shrinks
    for ever. 0 where not measured: not a CUDA device, torch not in use by this worker's runners."""
    import sys

    torch = sys.modules.get("torch")   # never imported here: a runner without torch pays nothing
    if torch is None or not device.startswith("cuda"):
        return 0
    try:
        if not torch.cuda.is_initialized():
            return 0
        peak = int(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    except Exception:   # no driver, a device torch cannot see: unmeasured, never fatal to a batch
        return 0


def batch_memory_fraction(peaks: dict[int, int], total_bytes: int | None) -> float | None:
    """The share of a device's memory its feeders' batches need: the sum of each feeder's last batch
    peak (`batch_peak_bytes`; each feeder process holds its own weights) over the device's total.
    None where nothing was measured (the caller then falls back to NVML's figure)."""
    measured = sum(v for v in peaks.values() if v > 0)
    if not measured or not total_bytes:
        return None
    return min(1.0, measured / total_bytes)
