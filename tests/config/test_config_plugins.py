"""Config validation (errors name file, key and rule) and plugin loading."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dynbatchd import config as cfgmod
from dynbatchd.cli.dynbatchd import app as dynbatchd_app
from dynbatchd.config import ConfigError
from dynbatchd.hookspecs import RequestInfo, hookimpl
from dynbatchd.plugins import PluginError, Plugins
from dynbatchd.validation import validate_config

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "etc" / "dynbatchd.toml"

BASE = """
[models.m]
runner = "noop"
[channels.standard]
max_batch = 8
window_ms = 10
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(textwrap.dedent(text))
    return path


def load_error(tmp_path: Path, text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        cfg = cfgmod.load(write(tmp_path, text))
        validate_config(cfg, Plugins.load())
    return info.value


@pytest.fixture(scope="module")
def plugins():
    return Plugins.load()


def test_shipped_config_is_the_guides_three_channels_and_routing(plugins):
    cfg = cfgmod.load(SHIPPED)
    validate_config(cfg, plugins)
    got = {n: (c.max_batch, c.window_ms) for n, c in cfg.channels.items()}
    assert got == {"realtime": (16, 30), "standard": (32, 100), "bulk": (8, 500)}
    route = lambda **kw: plugins.route(RequestInfo("minilm", **kw), cfg)
    assert route(tokens=9000) == "bulk"
    assert route(tokens=8192, tags=("urgent",)) == "realtime"
    assert route(tokens=100) == "standard"
    assert route(tokens=9000, tags=("urgent",)) == "bulk"   # first matching rule wins


@pytest.mark.parametrize("extra, key, rule", [
    ("[channels.standard.oops]\n", "channels.standard", "unknown field `oops`"),
    ("[bogus]\nx = 1\n", "", "unknown field `bogus`"),
])
def test_unknown_keys_are_errors(tmp_path, extra, key, rule):
    err = load_error(tmp_path, BASE + extra)
    assert err.key == key and rule in err.rule and err.file.endswith("c.toml")


@pytest.mark.parametrize("text, key, rule", [
    (BASE.replace("max_batch = 8", "max_batch = 0"), "channels.standard.max_batch", ">= 1"),
    (BASE.replace("window_ms = 10", 'window_ms = "fast"'), "channels.standard.window_ms", "expected `float`"),
    (BASE + "[routing]\ndefault = 'nowhere'\n", "routing.default", "unknown channel 'nowhere'"),
    (BASE + "[[routing.rules]]\ntag = 'x'\nchannel = 'gone'\n", "routing.rules[0].channel", "unknown channel 'gone'"),
    (BASE.replace('runner = "noop"', 'runner = "teleport"'), "models.m.runner", "unknown runner 'teleport'"),
    (BASE + "deadline_ms = 5\n", "channels.standard.window_ms", "exceeds the channel deadline"),
    (BASE + "[daemon]\nlisten = 'localhost:5555'\n", "daemon.listen", "not a ZeroMQ endpoint"),
    (BASE + "[devices]\nuse = ['gpu0']\n", "devices.use[0]", "not a device"),
    (BASE + "[channels.standard.window]\npolicy = 'psychic'\n", "channels.standard.window.policy", "unknown window policy"),
    (BASE + "[channels.standard.window]\npolicy = 'ewma'\noptions = { alpha = 2.0 }\n",
     "channels.standard.window.options.alpha", "must be <= 1"),
    # Not finite: nan passed every bound, and an adaptive sizer's grow = inf raised in the device
    # observer, which then stopped killing hung workers.
    (BASE + "[channels.standard.window]\npolicy = 'ewma'\noptions = { alpha = nan }\n",
     "channels.standard.window.options.alpha", "must be a finite number"),
    (BASE + "[channels.standard.batch_size]\npolicy = 'adaptive'\noptions = { grow = inf }\n",
     "channels.standard.batch_size.options.grow", "must be a finite number"),
])
def test_errors_name_the_key_and_the_rule(tmp_path, text, key, rule):
    err = load_error(tmp_path, text)
    assert err.key == key, str(err)
    assert rule in err.rule, str(err)
    assert str(err).startswith(f"{tmp_path / 'c.toml'}: {key}: ")


def test_not_toml_and_missing_file(tmp_path):
    assert "not valid TOML" in load_error(tmp_path, "[[[").rule
    with pytest.raises(ConfigError, match="cannot read"):
        cfgmod.load(tmp_path / "absent.toml")


def test_banking_channel_with_long_window_is_refused(tmp_path):
    text = BASE + """
    [channels.finance]
    max_batch = 8
    window_ms = 200
    isolated = true
    carries = ["banking"]
    """
    err = load_error(tmp_path, text)
    assert err.key == "channels.finance.window_ms"
    assert "banking" in err.rule and "150 ms" in err.rule and "compliance" in err.rule


def test_banking_routed_to_a_shared_channel_is_refused(tmp_path):
    err = load_error(tmp_path, BASE + "[[routing.rules]]\ntag = 'banking'\nchannel = 'standard'\n")
    assert err.key == "channels.standard.isolated" and "regulated" in err.rule


def test_check_config_command_prints_the_error(tmp_path):
    path = write(tmp_path, BASE.replace("max_batch = 8", "max_batch = -3"))
    result = CliRunner().invoke(dynbatchd_app, ["check-config", str(path)])
    assert result.exit_code == 2
    assert "channels.standard.max_batch" in result.output and ">= 1" in result.output
    ok = CliRunner().invoke(dynbatchd_app, ["check-config", str(SHIPPED)])
    assert ok.exit_code == 0 and "3 channels" in ok.output


def test_tuned_values_obey_the_same_rules():
    cfg = cfgmod.load(SHIPPED)
    assert cfgmod.with_channel(cfg, "realtime", window_ms=5.0).channels["realtime"].window_ms == 5.0
    with pytest.raises(ConfigError, match="max_batch"):
        cfgmod.with_channel(cfg, "realtime", max_batch=0)


# -- plugins --------------------------------------------------------------------

def test_builtin_plugins_load_through_entry_points(plugins):
    names = {p.name for p in plugins.describe()}
    assert {"routing", "windows", "compliance", "runners", "sizing"} <= names
    assert all(p.source.startswith("dynbatchd ") for p in plugins.describe() if p.name in names)
    assert {"sentence-embedding", "callable", "simulated", "noop"} <= set(plugins.runners())
    assert "fixed" in plugins.window_policies() and "static" in plugins.batch_sizers()


class ThirdPartyRouter:
    """A plugin added beside the built-ins: routes 'vip' users first."""

    @hookimpl
    def dynbatchd_route(self, request, config):
        return "realtime" if request.user == "vip" else None


def test_a_third_party_router_runs_before_the_builtin_rules():
    plugins = Plugins.load(extra=[ThirdPartyRouter()])
    cfg = cfgmod.load(SHIPPED)
    assert plugins.route(RequestInfo("minilm", user="vip", tokens=9000), cfg) == "realtime"
    assert plugins.route(RequestInfo("minilm", user="bob", tokens=9000), cfg) == "bulk"


class Misspelt:
    @hookimpl
    def dynbatchd_rout(self, request, config):  # typo: no such hook
        return None


def test_a_misspelt_hook_fails_loudly_at_start():
    with pytest.raises(PluginError, match="dynbatchd_rout"):
        Plugins.load(extra=[Misspelt()])


class DoubleRunner:
    @hookimpl
    def dynbatchd_runners(self):
        return {"noop": object}


def test_a_name_registered_twice_is_an_error():
    with pytest.raises(PluginError, match="noop"):
        Plugins.load(extra=[DoubleRunner()]).runners()


def test_a_broken_plugin_is_reported_and_skipped(tmp_path, monkeypatch):
    dist = tmp_path / "brokenplug-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenplug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[dynbatchd]\nbrokenplug = no_such_module_for_dynbatchd\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins = Plugins.load()
    assert "brokenplug" in plugins.broken and "No module named" in plugins.broken["brokenplug"]
    assert "routing" in {p.name for p in plugins.describe()}
