"""`dynbatchctl simulate`, `capacity` and `tune` on a generative config (issue 29): a causal-lm
model on a simulated device, offline, deterministic, no torch (the model directory holds only the
config.json the planner reads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dynbatchd.cli.dynbatchctl import app

MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_size": 4096, "intermediate_size": 11008,
         "max_position_embeddings": 4096, "vocab_size": 32000, "torch_dtype": "float16", "hidden_act": "silu"}


def generative_config(tmp_path: Path, extra_model: str = "") -> Path:
    """A 7B-shaped causal-lm model on an 80 GB device; realtime and standard with TTFT/TPOT targets."""
    model = tmp_path / "lm"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(MODEL))
    path = tmp_path / "gen.toml"
    path.write_text(f"""
[daemon]
control = "ipc://{tmp_path}/ctl"
[devices]
memory_gb = 80
[models.lm]
runner = "causal-lm"
options = {{ path = "{model}", simulated = {{ step_ms = 12.0, prefill_ms_per_token = 0.06 }}{extra_model} }}
[routing]
default = "standard"
[channels.realtime]
max_batch = 8
window_ms = 0
deadline_ms = 30000
priority = 2
ttft_ms = 1000
tpot_ms = 100
[channels.standard]
max_batch = 8
window_ms = 0
deadline_ms = 60000
priority = 1
ttft_ms = 3000
tpot_ms = 150
""")
    return path


def invoke(*args: str) -> dict:
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.fixture
def config(tmp_path) -> str:
    return str(generative_config(tmp_path))


def test_simulate_shows_continuous_goodput_above_static_and_labels_it(config):
    data = invoke("simulate", "--config", config, "--rate", "5", "--duration", "20")
    assert data["simulated"] is True and data["generative"] is True
    assert data["device"]["kv_source"].startswith("planner: 80 GB")      # the planner's formula
    cont, static = data["modes"]["continuous"], data["modes"]["static"]
    assert cont["goodput_tokens_per_s"] >= 2 * static["goodput_tokens_per_s"]
    assert cont["met_targets"] == cont["requests"] == 100
    assert set(cont["channels"]) == {"realtime", "standard"} and cont["kv_over_budget"] == 0
    assert data == invoke("simulate", "--config", config, "--rate", "5", "--duration", "20")   # deterministic
    table = CliRunner().invoke(app, ["simulate", "--config", config, "--rate", "5", "--duration", "5"])
    assert table.exit_code == 0 and "SIMULATED" in table.output and "static" in table.output


def test_simulate_one_mode_and_the_costs_from_the_command_line(config):
    data = invoke("simulate", "--config", config, "--rate", "5", "--duration", "5", "--mode", "continuous",
                  "--base-ms", "20")
    assert list(data["modes"]) == ["continuous"] and data["device"]["step_ms"] == 20.0


def test_the_k12_scenario_keeps_chat_within_target_and_never_overruns_the_kv(config):
    data = invoke("simulate", "--config", config, "--scenario", "k12", "--rate", "10", "--duration", "20",
                  "--mode", "continuous")
    run = data["modes"]["continuous"]
    assert set(run["channels"]) == {"chat", "grading"} and run["channels"]["grading"]["requests"] > 0
    assert data["targets"]["chat"] == {"priority": 2, "ttft_ms": 1000.0, "tpot_ms": 100.0}   # the guide's
    assert data["targets"]["realtime"]["ttft_ms"] == 1000.0                                   # the config's
    assert run["channels"]["chat"]["met_fraction"] >= 0.95
    assert run["kv_over_budget"] == 0 and run["kv_peak_bytes"] <= run["kv_budget_bytes"]


def test_an_unknown_scenario_is_one_line_and_exit_2(config):
    result = CliRunner().invoke(app, ["simulate", "--config", config, "--scenario", "nope"])
    assert result.exit_code == 2 and "--scenario" in result.output


def test_capacity_answers_for_a_generative_channel_and_grows_with_the_rate(config):
    answers = []
    for per_day in ("200k", "1M", "4M"):
        data = invoke("capacity", "--config", config, "--requests-per-day", per_day, "--duration", "5")
        assert data["simulated"] is True and data["generative"] is True
        assert data["device"]["kv_source"].startswith("planner: 80 GB")   # the h100-80gb profile's memory
        chosen = next(t for t in data["trials"] if t["devices"] == data["devices"])
        assert chosen["met_fraction"] >= 0.99
        assert all(t["met_fraction"] < 0.99 for t in data["trials"] if t["devices"] == data["devices"] - 1)
        assert data["static"]["devices"] >= data["devices"] and data["continuous_saves"] >= 0
        answers.append(data["devices"])
    assert answers == sorted(answers) and answers[0] < answers[-1], answers


def test_capacity_refuses_what_it_does_not_model_for_generation(config):
    result = CliRunner().invoke(app, ["capacity", "--config", config, "--compare-profile", "l4-24gb"])
    assert result.exit_code == 2 and "generative" in result.output


def test_tune_generative_recommends_by_simulation_and_changes_nothing(tmp_path):
    path = generative_config(tmp_path)
    before = path.read_text()
    data = invoke("--config", str(path), "tune", "realtime", "--generative", "--rate", "40", "--duration", "5")
    assert data["simulated"] is True and data["channel"] == "realtime" and len(data["trials"]) == 36
    best, now = data["recommended"], data["current"]
    assert (now["max_batch_sequences"], now["max_prefill_tokens"]) == (64, 4096)   # the runner's defaults
    assert max(t["channel_met_fraction"] for t in data["trials"]) == best["channel_met_fraction"]
    assert best["channel_met_fraction"] >= now["channel_met_fraction"]
    assert path.read_text() == before


def test_tune_generative_needs_a_channel_of_the_config(config):
    result = CliRunner().invoke(app, ["--config", config, "tune", "nope", "--generative"])
    assert result.exit_code == 2 and "nope" in result.output


def test_the_models_tpot_guard_is_simulated_and_keeps_every_k12_chat_turn_within_target(tmp_path):
    guarded = str(generative_config(tmp_path, extra_model=", tpot_guard = true"))
    data = invoke("simulate", "--config", guarded, "--scenario", "k12", "--rate", "10", "--duration", "30",
                  "--mode", "continuous")
    run = data["modes"]["continuous"]
    assert data["device"]["tpot_guard"] is True
    assert run["channels"]["chat"]["met_fraction"] == 1.0 and run["kv_over_budget"] == 0


def test_simulate_shares_the_load_over_the_devices_the_config_uses(tmp_path):
    path = generative_config(tmp_path)
    path.write_text(path.read_text().replace("memory_gb = 80", 'memory_gb = 80\nuse = ["cuda:0", "cuda:1"]'))
    data = invoke("simulate", "--config", str(path), "--rate", "10", "--duration", "10", "--mode", "continuous")
    assert data["devices"] == 2 and data["requests_per_device"] == 50
