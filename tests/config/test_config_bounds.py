"""Bounds a fuzzing pass found missing from the configuration's rules.

- Channel and model names were unbounded: ``check-config --risk`` of a 200 kB channel name wrote a
  200 kB log line. Now at most 128 characters, the error showing the name shortened.
- A channel name could contain ``~``, which the engine reserves for a canary's twin (``NAME~canary``).
- The bandit's ``windows`` and ``caps`` and the tiered (and pattern) ``tiers`` were unbounded: a reload
  of thousands of entries held the event loop while the policy was built. Now at most 64 entries,
  refused where every policy option is (`validate_config`: file, reload, tune and canary alike).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dynbatchd import config as cfgmod
from dynbatchd.cli.dynbatchd import app as daemon_app
from dynbatchd.config import ChannelSettings
from dynbatchd.config.rules import NAME_CHARS, TWIN_MARK
from dynbatchd.errors import ConfigError
from dynbatchd.plugins import Plugins
from dynbatchd.scheduler import build_channels
from dynbatchd.scheduler.options import MAX_ENTRIES
from dynbatchd.tuning.canary import CANARY_SUFFIX
from dynbatchd.validation import validate_config


def config_text(channel: str = "standard", model: str = "m", window: str = "") -> str:
    return textwrap.dedent(f"""
        [models."{model}"]
        runner = "noop"
        [channels."{channel}"]
        max_batch = 8
        window_ms = 10
        {window}
        [routing]
        default = "{channel}"
    """)


def load(tmp_path: Path, text: str) -> cfgmod.Config:
    path = tmp_path / "c.toml"
    path.write_text(text)
    config = cfgmod.load(path)
    validate_config(config, Plugins.load())
    return config


def load_error(tmp_path: Path, text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    return info.value


# -- names ---------------------------------------------------------------------

def test_a_channel_name_of_200_kb_is_refused_in_a_short_error_naming_it_shortened(tmp_path):
    name = "c" * 200_000
    err = load_error(tmp_path, config_text(channel=name))
    assert err.key == f"channels.{'c' * 40}...(200000 characters)", err.key
    assert err.rule == f"a name of at most {NAME_CHARS} characters, got 200000"
    assert len(str(err)) < 300


def test_a_model_name_past_128_characters_is_refused_naming_it_shortened(tmp_path):
    err = load_error(tmp_path, config_text(model="m" * 129))
    assert err.key == f"models.{'m' * 40}...(129 characters)", err.key
    assert err.rule == "a name of at most 128 characters, got 129"


def test_names_of_128_characters_still_load(tmp_path):
    config = load(tmp_path, config_text(channel="c" * NAME_CHARS, model="m" * NAME_CHARS))
    assert list(config.channels) == ["c" * 128] and list(config.models) == ["m" * 128]


def test_a_channel_named_like_a_canarys_twin_is_refused_naming_the_rule(tmp_path):
    err = load_error(tmp_path, config_text(channel="standard~canary"))
    assert err.key == "channels.standard~canary"
    assert err.rule.startswith("a channel name may not contain '~': the daemon reserves it for a canary's twin")


def test_any_tilde_in_a_channel_name_is_refused_but_a_model_may_have_one(tmp_path):
    assert load_error(tmp_path, config_text(channel="a~b")).key == "channels.a~b"
    assert list(load(tmp_path, config_text(model="m~1")).models) == ["m~1"]


def test_the_reserved_mark_is_the_one_the_canary_names_its_twin_with():
    assert CANARY_SUFFIX.startswith(TWIN_MARK)


def test_the_engine_still_builds_a_twin_channel_named_with_the_mark():
    # the twin is the engine's, built from settings: no config file names it
    twin = build_channels({"c" + CANARY_SUFFIX: ChannelSettings(max_batch=4, window_ms=0, deadline_ms=100)})
    assert list(twin) == ["c~canary"]


def test_a_tune_of_a_config_with_a_long_name_gets_the_file_error():
    long = "c" * 300
    config = cfgmod.Config(models={"m": cfgmod.ModelSettings(runner="noop")},
                           channels={long: ChannelSettings(max_batch=8, window_ms=10)},
                           routing=cfgmod.RoutingSettings(default=long))
    with pytest.raises(ConfigError) as info:
        cfgmod.with_channel(config, long, max_batch=4)
    assert info.value.key == f"channels.{'c' * 40}...(300 characters)"


def test_an_unknown_default_channel_of_200_kb_is_shown_shortened(tmp_path):
    text = config_text().replace('default = "standard"', f'default = "{"d" * 200_000}"')
    err = load_error(tmp_path, text)
    assert err.key == "routing.default" and len(str(err)) < 300, str(err)[:300]


def test_check_config_of_a_200_kb_channel_name_prints_one_short_line(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(config_text(channel="c" * 200_000))
    result = CliRunner().invoke(daemon_app, ["check-config", str(path)])
    assert result.exit_code == 2, result.output[:500]
    assert len(result.output) < 400 and "at most 128 characters" in result.output, result.output[:500]


def test_the_shipped_config_still_loads():
    shipped = Path(__file__).resolve().parents[2] / "etc" / "dynbatchd.toml"
    config = cfgmod.load(shipped)
    assert all(len(n) <= NAME_CHARS and TWIN_MARK not in n for n in config.channels)


# -- list options of window policies ----------------------------------------------

def window_table(policy: str, options: str) -> str:
    return f'[channels."standard".window]\npolicy = "{policy}"\noptions = {{ {options} }}'


def fractions(n: int) -> str:
    return "[" + ", ".join(f"{(i + 1) / n:.6f}" for i in range(n)) + "]"


def tiers(n: int) -> str:
    bounded = [f"{{ below_tokens = {i + 1}, window_ms = 5 }}" for i in range(n - 1)]
    return "[" + ", ".join([*bounded, "{ window_ms = 10 }"]) + "]"


@pytest.mark.parametrize("policy, option, value", [
    ("bandit", "windows", fractions), ("bandit", "caps", fractions),
    ("tiered", "tiers", tiers), ("pattern", "tiers", tiers)])
def test_a_policy_list_option_past_64_entries_is_refused_naming_the_option(tmp_path, policy, option, value):
    err = load_error(tmp_path, config_text(window=window_table(policy, f"{option} = {value(MAX_ENTRIES + 1)}")))
    assert err.key == f"channels.standard.window.options.{option}"
    assert err.rule == f"at most 64 entries, got {MAX_ENTRIES + 1}"


@pytest.mark.parametrize("policy, option, value", [
    ("bandit", "windows", fractions), ("bandit", "caps", fractions),
    ("tiered", "tiers", tiers), ("pattern", "tiers", tiers)])
def test_a_policy_list_option_of_64_entries_still_loads(tmp_path, policy, option, value):
    config = load(tmp_path, config_text(window=window_table(policy, f"{option} = {value(MAX_ENTRIES)}")))
    assert config.window_of("standard").policy == policy


def test_a_tune_or_canary_of_a_long_bandit_list_gets_the_file_error(tmp_path):
    config = load(tmp_path, config_text())
    window = {"policy": "bandit", "options": {"windows": [0.5] * 3000, "caps": [0.5] * 3000}}
    candidate = cfgmod.with_channel(config, "standard", window=window)   # what tune and canary check
    with pytest.raises(ConfigError) as info:
        validate_config(candidate, Plugins.load())
    assert (info.value.key, info.value.rule) == ("channels.standard.window.options.windows",
                                                 "at most 64 entries, got 3000")


@pytest.mark.parametrize("key", ["listen", "control"])
def test_an_ipc_path_longer_than_a_unix_socket_name_is_refused_naming_the_key(tmp_path, key):
    """Past 107 bytes the daemon's bind failed at start ('file name too long'); check-config said ok."""
    path = "/tmp/" + "a" * 103   # 108 bytes
    error = load_error(tmp_path, f'[daemon]\n{key} = "ipc://{path}"\n' + config_text())
    assert str(error).endswith(f"daemon.{key}: an ipc:// path is at most 107 bytes (the limit of a Unix "
                               "socket's name), not 108: binding it fails with 'file name too long'"), error
    assert load(tmp_path, f'[daemon]\n{key} = "ipc://{path[:-1]}"\n' + config_text())   # 107: the longest that binds
