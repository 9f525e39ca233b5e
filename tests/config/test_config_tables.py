"""Plugins own config tables (`dynbatchd_config_tables`): ``[plugins.NAME]`` is checked against the
owner's struct at validation, with the same key-naming errors as a core table (issue 25)."""

from __future__ import annotations

import tomllib
from typing import Annotated

import pytest
from msgspec import Meta

from dynbatchd import config as cfgmod
from dynbatchd.config import ConfigError, Frozen
from dynbatchd.hookspecs import hookimpl
from dynbatchd.plugins import PluginError, Plugins
from dynbatchd.validation import validate_config
from helpers import MINIMAL_CONFIG

BASE = MINIMAL_CONFIG


class ShadowSettings(Frozen, kw_only=True):
    share: Annotated[float, Meta(ge=0, le=1)] = 0.1
    target: str = ""


class ShadowPlugin:
    @hookimpl
    def dynbatchd_config_tables(self):
        return {"shadow": ShadowSettings}


def config(extra: str = "") -> cfgmod.Config:
    return cfgmod.parse(tomllib.loads(BASE + extra), "f.toml")


def test_the_builtin_warmup_plugin_owns_its_table():
    plugins = Plugins.load()
    assert plugins.table(config('[plugins.warmup]\nsource = "/x.jsonl"\n'), "warmup").source == "/x.jsonl"
    assert plugins.table(config(), "warmup").source == ""   # absent: the defaults
    with pytest.raises(ConfigError) as bad:
        validate_config(config('[plugins.warmup]\nsourse = "/x.jsonl"\n'), plugins)
    assert (bad.value.file, bad.value.key) == ("f.toml", "plugins.warmup")
    assert "sourse" in bad.value.rule


def test_a_third_party_table_is_checked_with_key_naming_errors():
    plugins = Plugins.load(extra=[ShadowPlugin()])
    assert plugins.table(config("[plugins.shadow]\nshare = 0.25\n"), "shadow") == ShadowSettings(share=0.25)
    with pytest.raises(ConfigError) as bad:
        validate_config(config("[plugins.shadow]\nshare = 2\n"), plugins)
    assert bad.value.key == "plugins.shadow.share"
    assert bad.value.rule == "expected `float` <= 1.0, got `2`"
    with pytest.raises(ConfigError) as typo:
        validate_config(config('[plugins.shadow]\ntraget = "x"\n'), plugins)
    assert typo.value.key == "plugins.shadow" and "traget" in typo.value.rule


def test_a_table_without_an_owner_stays_free_form():
    validate_config(config("[plugins.someone_else]\nanything = 1\n"), Plugins.load())


def test_two_plugins_cannot_own_one_table():
    class Again:
        @hookimpl
        def dynbatchd_config_tables(self):
            return {"shadow": dict}

    with pytest.raises(PluginError, match="config table 'shadow' is registered by two plugins"):
        Plugins.load(extra=[ShadowPlugin(), Again()]).config_tables()


def test_the_http_plugin_owns_the_top_level_http_table():
    """``[http]`` keeps its spelling (existing configs load) but its shape and rules are the plugin's:
    a misspelt key or a broken rule is found by validation, naming ``http.KEY``."""
    from dynbatchd_plugins.http_config import HttpSettings, http_settings

    plugins = Plugins.load()
    cfg = config('[http]\nlisten = "127.0.0.1:8080"\nmax_inputs = 4\n')
    assert cfg.http == {"listen": "127.0.0.1:8080", "max_inputs": 4}   # the core keeps it free-form
    assert http_settings(cfg) == HttpSettings(listen="127.0.0.1:8080", max_inputs=4)
    assert plugins.table(cfg, "http") == http_settings(cfg)
    assert http_settings(config()).listen == ""   # absent: the defaults, the door off
    for text, key, words in (('lisen = "127.0.0.1:8080"', "http", "lisen"),
                             ("max_inputs = 0", "http.max_inputs", ">= 1"),
                             ('listen = "nowhere"', "http.listen", "not HOST:PORT"),
                             ('listen = "127.0.0.1:8080"\ntls_cert = "c.pem"', "http.tls_key", "together")):
        with pytest.raises(ConfigError) as bad:
            validate_config(config(f"[http]\n{text}\n"), plugins)
        assert (bad.value.file, bad.value.key) == ("f.toml", key) and words in bad.value.rule
    with pytest.raises(ConfigError) as elsewhere:   # one spelling, so no table is silently ignored
        validate_config(config('[plugins.http]\nlisten = "127.0.0.1:8080"\n'), plugins)
    assert elsewhere.value.key == "plugins.http" and "[http]" in elsewhere.value.rule


def test_a_top_level_table_the_core_keeps_for_no_plugin_cannot_be_claimed():
    class Claims(Frozen, kw_only=True):
        table_key = "daemonic"   # unannotated: a class attribute, not a field

    class Greedy:
        @hookimpl
        def dynbatchd_config_tables(self):
            return {"greedy": Claims}

    with pytest.raises(PluginError, match=r"claims \[daemonic\]"):
        validate_config(config(), Plugins.load(extra=[Greedy()]))


def test_the_config_command_shows_http_with_its_defaults_as_before():
    """`dynbatchctl config` showed every [http] key while the table was the core's; it still does."""
    from types import SimpleNamespace

    from dynbatchd.control import commands

    daemon = SimpleNamespace(config=config('[http]\nlisten = "127.0.0.1:8080"\n'), plugins=Plugins.load())
    shown = commands.config(daemon)
    assert shown["http"]["listen"] == "127.0.0.1:8080" and shown["http"]["max_inputs"] == 2048
    assert shown["http"]["keys"] is False and shown["plugins"] == {}
