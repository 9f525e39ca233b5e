"""[channels.NAME] ttft_ms / tpot_ms (issue 29): accepted where a causal-lm model generates
tokens, refused with the key named otherwise, on load and on a reload's load alike."""

from __future__ import annotations

import pytest

from dynbatchd import config as cfgmod
from dynbatchd.config import ConfigError

GEN = """
[models.lm]
runner = "causal-lm"
options = { path = "/nonexistent" }
[routing]
default = "chat"
[channels.chat]
max_batch = 8
window_ms = 0
deadline_ms = 30000
"""


def parse(text: str):
    import tomllib
    return cfgmod.parse(tomllib.loads(text), "t.toml")


def refusal(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(text)
    return info.value


def test_targets_are_accepted_on_a_generative_config_and_default_to_none():
    cfg = parse(GEN + "ttft_ms = 500\ntpot_ms = 80\n")
    assert (cfg.channels["chat"].ttft_ms, cfg.channels["chat"].tpot_ms) == (500.0, 80.0)
    assert parse(GEN).channels["chat"].ttft_ms is None and parse(GEN).channels["chat"].tpot_ms is None


@pytest.mark.parametrize("key", ["ttft_ms", "tpot_ms"])
@pytest.mark.parametrize("value", ["0", "-1", '"fast"', "1e12"])
def test_a_target_out_of_range_is_refused_naming_the_key(key, value):
    exc = refusal(GEN + f"{key} = {value}\n")
    assert exc.key == f"channels.chat.{key}"


@pytest.mark.parametrize("key", ["ttft_ms", "tpot_ms"])
def test_a_target_past_the_deadline_is_refused(key):
    exc = refusal(GEN + f"{key} = 40000\n")
    assert exc.key == f"channels.chat.{key}" and "deadline" in exc.rule


def test_a_target_without_a_generative_model_is_refused():
    text = GEN.replace('runner = "causal-lm"\noptions = { path = "/nonexistent" }', 'runner = "simulated"')
    exc = refusal(text + "ttft_ms = 500\n")
    assert exc.key == "channels.chat.ttft_ms" and "causal-lm" in exc.rule


def test_a_reload_reads_the_file_through_the_same_rules(tmp_path):
    path = tmp_path / "d.toml"
    path.write_text(GEN + "ttft_ms = 500\n")
    assert cfgmod.load(path).channels["chat"].ttft_ms == 500.0
    path.write_text(GEN + "ttft_ms = 50000\n")
    with pytest.raises(ConfigError) as info:
        cfgmod.load(path)
    assert info.value.key == "channels.chat.ttft_ms"
