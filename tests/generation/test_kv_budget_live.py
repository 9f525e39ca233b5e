"""The live worker's KV budget (dynbatchd.generation.serving.kv_budget_for): the option, else the
planner's formula on a CUDA device's memory (as the simulator sizes it from [devices] memory_gb),
else the default on a CPU. No GPU needed: the device's memory is stood in for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dynbatchd.generation import serving
from dynbatchd.generation.kv import kv_budget_tokens_of

GIB = 1 << 30


def llama_dir(tmp_path):
    """A 7B-shaped decoder's config.json (no weights: the planner reads the config only)."""
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,'
        ' "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,'
        ' "max_position_embeddings": 4096, "torch_dtype": "float16"}')
    return str(tmp_path)


def test_on_a_cuda_device_the_budget_is_the_planners_formula_on_its_memory(tmp_path, monkeypatch):
    path = llama_dir(tmp_path)
    monkeypatch.setattr(serving, "device_total_bytes", lambda device: 80 * GIB if device == "cuda:0" else 0)
    budget = serving.kv_budget_for(SimpleNamespace(device="cuda:0", options={"path": path}))
    assert budget == kv_budget_tokens_of(path, 80 * GIB)
    # 80 GiB less 20%, the float16 weights (~13 GiB) and a reserve, at 512 KiB a token: ~100k tokens
    assert 80_000 < budget < 120_000
    smaller = serving.kv_budget_for(SimpleNamespace(device="cuda:0", options={"path": path, "dtype": "float32"}))
    assert smaller < budget   # float32 KV and weights: fewer tokens fit


@pytest.mark.parametrize("device, options, expected", [
    ("cuda:0", {"kv_budget_tokens": 1234}, 1234),                  # the option wins
    ("cpu", {}, serving.DEFAULT_KV_BUDGET_TOKENS),                  # a CPU's memory is not planned
    ("cuda:0", {"path": "/nonexistent"}, serving.DEFAULT_KV_BUDGET_TOKENS),   # no config.json to read
])
def test_the_option_wins_and_without_anything_to_size_from_the_default_holds(device, options, expected, monkeypatch):
    monkeypatch.setattr(serving, "device_total_bytes", lambda device: 80 * GIB if device.startswith("cuda") else 0)
    assert serving.kv_budget_for(SimpleNamespace(device=device, options=options)) == expected
