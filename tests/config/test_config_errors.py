"""dynbatchd.errors: one base class, and key and rule carried as attributes (issue 25).

A caller reads `exc.key` and `exc.rule`, never the text; the text is built from them. Every
exception class the package raises on purpose derives from `DynbatchdError`, checked statically.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dynbatchd import config as cfgmod, errors
from dynbatchd.config import ConfigError
from dynbatchd.errors import DynbatchdError, OptionError
from dynbatchd.plugins import PluginError, Plugins
from dynbatchd.scheduler import build_channels
from dynbatchd.validation import check_runner_options, validate_config
from helpers import MINIMAL_CONFIG

ROOT = Path(__file__).resolve().parents[2]
BASE = MINIMAL_CONFIG
# Exception classes that need not derive from the base, with why. Shrink it; add nothing unexplained.
NOT_YET: dict[str, str] = {   # path -> why (empty: every class is under the base)
}
INTERNAL = {"SimulationError": "an invariant broken: a bug, not a refusal", "_Stop": "control flow in bench",
            "OneLineErrors": "a typer group, not an exception"}


def test_config_error_carries_file_key_and_rule_and_builds_its_text_from_them():
    exc = ConfigError("etc/x.toml", "channels.rt.max_batch", "expected `int` >= 1, got `0`")
    assert (exc.file, exc.key, exc.rule) == ("etc/x.toml", "channels.rt.max_batch", "expected `int` >= 1, got `0`")
    assert str(exc) == "etc/x.toml: channels.rt.max_batch: expected `int` >= 1, got `0`"
    assert str(ConfigError("etc/x.toml", "", "not valid TOML")) == "etc/x.toml: not valid TOML"
    assert isinstance(exc, DynbatchdError) and not isinstance(exc, ValueError)
    assert cfgmod.ConfigError is errors.ConfigError


def test_option_error_is_typed_and_still_a_value_error():
    exc = OptionError("cuda:1.memory_items", "expected an integer >= 0")
    assert (exc.key, exc.option, exc.rule) == ("cuda:1.memory_items", "cuda:1.memory_items", "expected an integer >= 0")
    assert str(exc) == "cuda:1.memory_items: expected an integer >= 0"
    assert isinstance(exc, ValueError) and isinstance(exc, DynbatchdError)
    from dynbatchd.devices.runners import OptionError as RunnerOptionError
    assert RunnerOptionError is OptionError
    as_config = ConfigError.of_option("f.toml", "models.m.options", exc)
    assert (as_config.key, as_config.rule) == ("models.m.options.cuda:1.memory_items", exc.rule)


def test_a_config_file_error_names_file_key_and_rule():
    with pytest.raises(ConfigError) as bad:
        cfgmod.parse({**_base(), "channels": {"standard": {"max_batch": 0, "window_ms": 5}}}, "f.toml")
    assert (bad.value.file, bad.value.key) == ("f.toml", "channels.standard.max_batch")
    assert bad.value.rule.startswith("expected `int` >= 1")


@pytest.mark.parametrize("window, key, rule", [
    ({"policy": "psychic"}, "channels.standard.window.policy", "unknown window policy 'psychic'"),
    ({"policy": "ewma", "options": {"alhpa": 1}}, "channels.standard.window.options", "unknown option 'alhpa'"),
])
def test_the_scheduler_raises_option_errors_that_validation_turns_into_config_errors(window, key, rule):
    cfg = cfgmod.parse({**_base(), "channels": {"standard": {"max_batch": 8, "window_ms": 5, "window": window}}},
                       "f.toml")
    plugins = Plugins.load()
    with pytest.raises(OptionError) as raw:
        build_channels(cfg.channels, plugins.window_policies(), plugins.batch_sizers())
    assert raw.value.key == key and raw.value.rule.startswith(rule)
    with pytest.raises(ConfigError) as bad:
        validate_config(cfg, plugins)
    assert (bad.value.file, bad.value.key) == ("f.toml", key) and bad.value.rule.startswith(rule)


def test_a_third_party_runner_that_raises_a_plain_value_error_is_named_by_its_table():
    def picky(value):
        raise ValueError("needs a path")

    class Picky:
        OPTIONS = {"path": picky}

    with pytest.raises(ConfigError) as bad:
        check_runner_options("f.toml", "m", Picky, {"path": 1})
    assert (bad.value.key, bad.value.rule) == ("models.m.options", "needs a path")
    with pytest.raises(ConfigError) as typed:
        check_runner_options("f.toml", "m", Picky, {"paht": 1})
    assert typed.value.key == "models.m.options.paht" and typed.value.rule.startswith("unknown option")


def test_plugin_errors_and_key_file_errors_share_the_base():
    assert issubclass(PluginError, DynbatchdError)
    assert issubclass(cfgmod.KeyFileError, DynbatchdError) and issubclass(cfgmod.KeyFileError, ValueError)
    assert issubclass(cfgmod.UnsafeDirectory, DynbatchdError) and issubclass(cfgmod.UnsafeDirectory, OSError)
    with pytest.raises(OptionError):
        cfgmod.write_keypair("/nonexistent-dir-never-made", "no spaces allowed")


def test_every_exception_class_of_the_package_derives_from_the_base():
    """Statically: a class based only on built-in exceptions is a stray (the base itself aside)."""
    strays = []
    for package in ("dynbatchd", "plugins"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in NOT_YET:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ClassDef) or node.name in INTERNAL or rel == "dynbatchd/errors.py":
                    continue
                bases = [ast.unparse(b) for b in node.bases]
                if any(b.split(".")[-1] in ("Exception", "ValueError", "KeyError", "RuntimeError", "OSError",
                                            "TypeError", "AssertionError") for b in bases) \
                        and not any("Error" in b and b not in ("ValueError", "KeyError", "RuntimeError", "OSError",
                                                                "TypeError", "AssertionError") for b in bases):
                    strays.append(f"{rel}: class {node.name}({', '.join(bases)})")
    assert strays == [], "derive these from dynbatchd.errors.DynbatchdError:\n" + "\n".join(strays)


def _base() -> dict:
    import tomllib
    return tomllib.loads(BASE)


def test_every_exception_class_the_package_defines_is_a_dynbatchd_error_at_run_time():
    """The same, by importing: a class that derives from another of ours that is itself a stray is
    caught here, where the static look above only sees names. The client's errors and the HTTP
    door's are under the one base too."""
    import importlib
    import pkgutil

    import dynbatchd
    import dynbatchd_plugins
    from dynbatchd import client
    from dynbatchd_plugins import httpwire

    strays = []
    for package in (dynbatchd, dynbatchd_plugins):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.endswith("__main__"):   # runs the CLI when imported
                continue
            module = importlib.import_module(info.name)
            for value in vars(module).values():
                if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == info.name \
                        and value.__name__ not in INTERNAL and not issubclass(value, DynbatchdError):
                    strays.append(f"{info.name}.{value.__name__}")
    assert strays == []
    assert issubclass(client.Overloaded, DynbatchdError) and issubclass(client.Timeout, TimeoutError)
    assert issubclass(httpwire.HttpError, DynbatchdError) and issubclass(httpwire.ClientGone, DynbatchdError)
