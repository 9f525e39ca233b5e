"""Built-ins own their keys of the shared tables (issue 25): ``[routing] rules`` is the routing
plugin's, ``[compliance] regulated_tags`` / ``banking_max_window_ms`` the compliance plugin's,
``[cache] refresh_types`` / ``rare_users`` the lifecycle cache policy's. Spelled as configs always
had them; checked by their owners as strictly as the core checked them; refused as unknown where
no loaded plugin owns them; kept through every dump and re-read of a config."""

from __future__ import annotations

import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from typer.testing import CliRunner

from dynbatchd import config as cfgmod
from dynbatchd.cli.dynbatchd import app as dynbatchd_app
from dynbatchd.config import ConfigError, Frozen
from dynbatchd.control import commands
from dynbatchd.engine.intake import sim_config
from dynbatchd.hookspecs import CacheRule, RequestInfo, hookimpl
from dynbatchd.plugins import PluginError, Plugins
from dynbatchd.validation import validate_config
from dynbatchd_plugins.compliance_config import ComplianceRules
from helpers import MINIMAL_CONFIG

SHIPPED = Path(__file__).resolve().parents[2] / "etc" / "dynbatchd.toml"
BASE = MINIMAL_CONFIG + """
[channels.vault]
max_batch = 8
window_ms = 5
isolated = true
"""


def config(extra: str = "") -> cfgmod.Config:
    return cfgmod.parse(tomllib.loads(BASE + extra), "f.toml")


def refusal(cfg: cfgmod.Config, plugins: Plugins | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, plugins or Plugins.load())
    assert info.value.file == "f.toml"
    return info.value


def without(name: str, extra: list[object] = ()) -> Plugins:
    """The installed plugins less the built-in `name` (plus `extra`): a daemon where it failed to load."""
    loaded = Plugins.load(extra=list(extra))
    loaded.pm.unregister(name=name)
    return Plugins(loaded.pm, {name: "not loaded (test)"}, loaded.sources)


def test_the_core_sets_aside_the_keys_plugins_own_and_their_owners_read_them():
    cfg = config('[routing]\ndefault = "standard"\n[[routing.rules]]\ntag = "x"\nchannel = "vault"\n'
                 '[compliance]\nregulated_tags = ["x"]\naudit_log = "/a.jsonl"\n'
                 '[cache]\nentries = 4\nrare_users = ["once"]\n')
    assert cfg.routing == cfgmod.RoutingSettings(default="standard") and cfg.compliance.audit_log == "/a.jsonl"
    assert cfg.plugin_keys == {"routing": {"rules": [{"tag": "x", "channel": "vault"}]},
                               "compliance": {"regulated_tags": ["x"]}, "cache": {"rare_users": ["once"]}}
    plugins = Plugins.load()
    validate_config(cfg, plugins)
    assert [(r.tag, r.channel) for r in plugins.table(cfg, "routing").rules] == [("x", "vault")]
    assert plugins.table(cfg, "compliance") == ComplianceRules(regulated_tags=["x"])
    assert plugins.table(cfg, "cache").rare_users == ["once"] and plugins.table(cfg, "cache").refresh_types
    assert plugins.route(RequestInfo("m", tags=("x",)), cfg) == "vault"


@pytest.mark.parametrize("extra, key, words", [
    ("[compliance]\nregulated_tagz = ['x']\n", "compliance", "unknown field `regulated_tagz`"),
    ("[compliance]\nbanking_max_window_ms = -1\n", "compliance.banking_max_window_ms", ">= 0"),
    ("[routing]\nrulez = []\n", "routing", "unknown field `rulez`"),
    ("[[routing.rules]]\nchanel = 'vault'\n", "routing.rules[0]", "unknown field `chanel`"),
    ("[[routing.rules]]\ntag = 'x'\nchannel = 'vault'\ntokens_above = -5\n", "routing.rules[0].tokens_above", ">= 0"),
    ("[[routing.rules]]\nchannel = 'vault'\nmodel = 'gone'\n", "routing.rules[0].model", "unknown model 'gone'"),
    ("[cache]\nrare_user = ['x']\n", "cache", "unknown field `rare_user`"),
    ("[cache]\nrefresh_types = 'session_refresh'\n", "cache.refresh_types", "expected `array`"),
])
def test_a_misspelt_or_broken_plugin_key_is_refused_naming_it(extra, key, words):
    err = refusal(config(extra))
    assert err.key == key and words in err.rule, str(err)


@pytest.mark.parametrize("owner, extra, field", [
    ("routing", "[[routing.rules]]\ntag = 'x'\nchannel = 'vault'\n", "rules"),
    ("compliance", "[compliance]\nbanking_max_window_ms = 100\n", "banking_max_window_ms"),
    ("cache", "[cache]\nrefresh_types = []\n", "refresh_types"),
])
def test_a_plugin_key_whose_owner_is_not_loaded_is_an_unknown_field(owner, extra, field):
    err = refusal(config(extra), without(owner))
    assert err.key == owner and f"unknown field `{field}`" in err.rule, str(err)
    without(owner).check_tables(config())   # the core's keys alone are no one's to refuse


def test_a_file_cannot_spell_the_field_that_holds_the_plugin_keys():
    with pytest.raises(ConfigError, match="unknown field `plugin_keys`"):
        cfgmod.parse({**tomllib.loads(BASE), "plugin_keys": {"routing": {}}}, "f.toml")


def test_a_config_dumped_and_read_again_keeps_the_plugin_keys():
    shipped = cfgmod.load(SHIPPED)
    assert shipped.plugin_keys["routing"]["rules"] and shipped.plugin_keys["compliance"]["regulated_tags"]
    dumped = cfgmod.to_dict(shipped)
    assert "plugin_keys" not in dumped
    assert dumped["routing"] == {"default": "standard", **shipped.plugin_keys["routing"]}
    assert cfgmod.parse({k: v for k, v in dumped.items() if k != "source"}, shipped.source) == shipped
    tuned = cfgmod.with_channel(shipped, "standard", window_ms=20.0)
    assert tuned.plugin_keys == shipped.plugin_keys and tuned.channels["standard"].window_ms == 20.0
    plugins = Plugins.load()
    validate_config(tuned, plugins)
    assert plugins.route(RequestInfo("minilm", tokens=9000), tuned) == "bulk"   # the rules survived
    assert cfgmod.table_of(tuned, "routing") == dumped["routing"]


def test_the_config_command_shows_each_shared_table_whole_with_the_owners_defaults():
    cfg = config('[[routing.rules]]\ntag = "x"\nchannel = "vault"\n[compliance]\naudit_log = "/a.jsonl"\n')
    shown = commands.config(SimpleNamespace(config=cfg, plugins=Plugins.load()))
    assert shown["routing"]["default"] == "standard" and shown["routing"]["rules"][0]["channel"] == "vault"
    assert shown["compliance"]["audit_log"] == "/a.jsonl" and shown["compliance"]["banking_max_window_ms"] == 150.0
    assert shown["cache"]["refresh_types"] == ["session_refresh"] and shown["cache"]["entries"] == 0
    assert "plugin_keys" not in shown


def test_check_config_counts_the_routing_plugins_rules():
    result = CliRunner().invoke(dynbatchd_app, ["check-config", str(SHIPPED)])
    assert result.exit_code == 0 and "2 routing rules" in result.output, result.output


def test_per_request_hooks_convert_a_table_once_per_config(monkeypatch):
    import dynbatchd_plugins.compliance_config as compliance_config
    import dynbatchd_plugins.routing_config as routing_config

    converted = []
    for module in (routing_config, compliance_config):
        def counted(config, typ, real=module.plugin_table):
            converted.append(typ.__name__)
            return real(config, typ)
        monkeypatch.setattr(module, "plugin_table", counted)
    cfg = config('[[routing.rules]]\ntag = "x"\nchannel = "vault"\n[compliance]\nregulated_tags = ["x"]\n')
    plugins = Plugins.load()
    for _ in range(3):
        assert plugins.route(RequestInfo("m", tags=("x",)), cfg) == "vault"
        assert plugins.admit(RequestInfo("m", tags=("x",)), "standard", cfg)   # the config's own regulated tag
    assert sorted(converted) == ["ComplianceRules", "RoutingRules"]
    again = cfgmod.with_channel(cfg, "standard", window_ms=1.0)   # a new config object: read anew, once
    for _ in range(2):
        assert plugins.route(RequestInfo("m", tags=("x",)), again) == "vault"
        assert plugins.admit(RequestInfo("m", tags=("x",)), "standard", again)
    assert len(converted) == 4
    assert plugins.admit(RequestInfo("m", tags=("x",)), "standard", config()) is None   # not regulated there


def test_configs_asked_in_turn_are_each_built_once_while_few():
    """The live config and a candidate simulated beside it (risk assessment, canary) alternate."""
    built = []
    of = cfgmod.PerConfig(lambda config: built.append(config) or len(built))
    live, candidate = object(), object()
    assert [of(live), of(candidate), of(live), of(candidate)] == [1, 2, 1, 2] and built == [live, candidate]
    assert of.last == (candidate, 2)
    for other in (object() for _ in range(of.KEEP)):   # the oldest beyond KEEP is let go
        of(other)
    assert of(live) == 2 + of.KEEP + 1


def test_the_simulator_routes_by_a_routing_table_as_a_file_spells_it():
    channels = config().channels
    sim = sim_config(channels, {"default": "standard", "rules": [{"tag": "x", "channel": "vault"}]})
    plugins = Plugins.load()
    assert plugins.channel_for(RequestInfo("m", tags=("x",)), sim) == "vault"
    assert plugins.channel_for(RequestInfo("m"), sim) == "standard"
    assert plugins.channel_for(RequestInfo("m", tags=("x",)), sim_config(channels)) == "standard"
    with pytest.raises(TypeError, match=r"\[routing\] table"):   # the core's struct alone would drop the rules
        sim_config(channels, cfgmod.RoutingSettings(default="vault"))


# -- a third-party plugin claims a shared table's plugin keys -------------------------------------

class TtlSettings(Frozen, kw_only=True):
    table_key: ClassVar[str] = "cache"
    ttl_s: float = 60.0


class TtlCache:
    """A cache plugin of its own, in place of the built-in one: policy ``ttl`` and its ``[cache] ttl_s``."""

    @hookimpl
    def dynbatchd_config_tables(self) -> dict[str, type]:
        return {"ttl": TtlSettings}

    @hookimpl
    def dynbatchd_cache_policies(self) -> dict[str, Any]:
        def ttl(config: Any):
            settings = cfgmod.convert(cfgmod.plugin_keys_of(config, "cache"), TtlSettings, config.source, "cache")
            rule = CacheRule(store="always" if settings.ttl_s > 0 else "never")
            return lambda request: rule
        return {"ttl": ttl}


def test_a_third_party_plugin_can_own_keys_of_a_shared_table():
    plugins = without("cache", [TtlCache()])
    cfg = config('[cache]\nentries = 8\npolicy = "ttl"\nttl_s = 0\n')
    validate_config(cfg, plugins)
    assert plugins.table(cfg, "ttl") == TtlSettings(ttl_s=0.0)
    assert plugins.cache_policies()["ttl"](cfg)(RequestInfo("m")).store == "never"
    err = refusal(config('[cache]\npolicy = "ttl"\nttl = 5\n'), plugins)
    assert err.key == "cache" and "unknown field `ttl`" in err.rule
    err = refusal(config('[cache]\npolicy = "ttl"\nrare_users = []\n'), plugins)   # lifecycle's: not loaded
    assert err.key == "cache" and "unknown field `rare_users`" in err.rule


def test_two_plugins_cannot_claim_one_shared_table():
    with pytest.raises(PluginError, match=r"both claim \[cache\]"):
        Plugins.load(extra=[TtlCache()]).config_tables()
