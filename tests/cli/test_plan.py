"""`dynbatchctl plan`: offline capacity planning from a model's config.json and device memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from dynbatchd import config as cfgmod
from dynbatchd.cli import plan as planmod
from dynbatchd.memory import GIB

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()

app = typer.Typer()
app.command()(planmod.plan)


@app.callback()
def _group() -> None:
    """Stands in for dynbatchctl: `plan` is a subcommand."""


LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
            "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "vocab_size": 128256}


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    """NVML answers nothing unless a test says otherwise, so results do not depend on the machine."""
    monkeypatch.setattr(planmod, "nvml_memory", lambda index: None)
    monkeypatch.delenv("DYNBATCHD_CONFIG", raising=False)


@pytest.fixture
def llama(tmp_path) -> Path:
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA_8B))
    with open(d / "model.safetensors", "wb") as f:
        f.truncate(14 * GIB)                                 # sparse: sized, not written
    return d


@pytest.fixture
def config(tmp_path, llama) -> Path:
    path = tmp_path / "dynbatchd.toml"
    path.write_text(f"""
[devices]
memory_gb = 40.0

[models.llama]
runner = "callable"
options = {{ path = "{llama}", max_tokens = 4096 }}

[channels.realtime]
max_batch = 16
window_ms = 30

[channels.standard]
max_batch = 64
window_ms = 100
max_tokens = 200000

[routing]
default = "standard"
""")
    return path


def invoke(*args: str):
    return runner.invoke(app, ["plan", *args], env={"COLUMNS": "200"})   # wide enough that rows do not wrap


def test_json_gives_the_arithmetic_and_a_row_per_channel(config):
    result = invoke("--config", str(config), "--memory-gb", "80", "--reserve-gb", "1", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    mem = data["memory"]
    # 2 × 32 × 8 × 128 × 4096 × 2 B = 512 MiB per request; 80·0.8 − 14 − 1 = 49 GiB usable → 98.
    assert mem["per_request_bytes"] == 512 << 20 and mem["usable_bytes"] == 49 * GIB and mem["max_batch"] == 98
    assert data["model"]["seq_len"] == 4096 and data["model"]["weights_bytes"] == 14 * GIB
    assert data["device"] == {"name": "device", "total_bytes": 80 * GIB, "source": "--memory-gb"}
    rows = {r["channel"]: r for r in data["channels"]}
    assert (rows["realtime"]["recommended_max_batch"], rows["realtime"]["status"]) == (16, "fits")
    assert (rows["standard"]["recommended_max_batch"], rows["standard"]["status"]) == (64, "fits")
    # 49 GiB / 128 KiB per token = 401408 tokens: the 200000-token cap fits.
    assert rows["standard"]["token_budget"] == 401408 and rows["standard"]["max_tokens_fits"] is True


def test_tables_show_the_steps_and_what_to_lower(config):
    result = invoke("--config", str(config), "--reserve-gb", "1")    # memory from devices.memory_gb = 40
    assert result.exit_code == 0, result.output
    out = result.stdout
    for text in ("memory arithmetic", "after headroom", "weights (once)", "per request", "max batch per channel",
                 "2 × 32 layers × 8 kv_heads × 128 head_dim × 4096 tokens × 2 B", "devices.memory_gb"):
        assert text in out, text
    # 40·0.8 − 14 − 1 = 17 GiB → 34 requests: standard (64) must come down, realtime (16) fits.
    assert "floor(17.00 GiB / 512.00 MiB)" in out
    assert "lower to 34" in out and "fits" in out


def test_the_configured_figure_wins_over_nvml_as_in_the_daemon(config, monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(planmod, "nvml_memory", lambda index: seen.append(index) or ("NVIDIA H200", 140 * GIB))
    data = json.loads(invoke("--config", str(config), "--gpu", "1", "--json").stdout)
    assert not seen and data["device"]["source"].endswith("devices.memory_gb")
    assert data["memory"]["total_bytes"] == 40 * GIB
    bare = tmp_path / "bare.toml"   # no memory_gb in the config: NVML's
    bare.write_text(config.read_text().replace("memory_gb = 40.0", ""))
    data = json.loads(invoke("--config", str(bare), "--gpu", "1", "--json").stdout)
    assert seen == [1] and data["device"]["source"] == "NVML (GPU 1)" and data["device"]["name"] == "NVIDIA H200"
    assert data["memory"]["total_bytes"] == 140 * GIB


def test_a_model_directory_without_a_config_file(llama, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cfgmod.paths, "DEFAULT_CONFIG_PATHS", ())
    result = invoke("--model", str(llama), "--memory-gb", "24", "--seq-len", "1024", "--dtype", "float16", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["config"] is None and data["channels"] == []
    assert data["memory"]["per_request_bytes"] == 2 * 32 * 8 * 128 * 1024 * 2


def test_the_shipped_config_plans_the_bundled_minilm():
    result = invoke("--config", str(REPO / "etc" / "dynbatchd.toml"), "--memory-gb", "16", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["model"]["kind"] == "encoder" and data["model"]["seq_len"] == 256      # the runner's max_tokens
    assert data["memory"]["per_request_bytes"] == 9 << 20
    assert {r["channel"]: r["status"] for r in data["channels"]} == {"realtime": "fits", "standard": "fits",
                                                                     "bulk": "fits"}


@pytest.mark.parametrize("args, message", [
    (("--memory-gb", "8", "--model", "nope"), "neither a model of the config nor a path"),
    ((), "device memory unknown"),
])
def test_errors_are_one_line_and_exit_2(args, message, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text((REPO / "etc" / "dynbatchd.toml").read_text())
    result = invoke("--config", str(cfg), *args)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_a_broken_config_names_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[channels.x]\nmax_batch = 0\n")
    result = invoke("--config", str(bad), "--memory-gb", "8")
    assert result.exit_code == 2 and "bad.toml" in result.output
