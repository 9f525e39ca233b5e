"""Checks a configuration must pass beyond its structure, at load, reload and tune.

Structure (types, ranges, unknown keys, references) is `dynbatchd.config`'s
job; this module adds what needs the plugins: known runners (with the options
each declares) and policies (with their options), and every compliance rule.
Nothing here builds a runner, so no model library (torch) is imported.
"""

from __future__ import annotations

from dynbatchd.config import Config, ConfigError
from dynbatchd.plugins import Plugins
from dynbatchd.scheduler import build_channels


def validate_config(config: Config, plugins: Plugins) -> None:
    """Raise ConfigError (file, key, rule) for the first problem found."""
    runners = plugins.runners()
    for name, model in config.models.items():
        if model.runner not in runners:
            raise ConfigError(config.source, f"models.{name}.runner",
                              f"unknown runner {model.runner!r} (known: {', '.join(sorted(runners))})")
        check_runner_options(config.source, name, runners[model.runner], model.options)
    try:
        build_channels(config.channels, plugins.window_policies(), plugins.batch_sizers())
    except KeyError as exc:
        key, _, rule = str(exc.args[0]).partition(": ")
        raise ConfigError(config.source, key, rule) from None
    except (TypeError, ValueError, OverflowError) as exc:
        # Policies name the option in their message: "channels.X.window.options.alpha: must be ..."
        key, sep, rule = str(exc).partition(": ")
        if not (sep and key.startswith("channels.")):
            key, rule = "channels", f"policy options rejected: {exc}"
        raise ConfigError(config.source, key, rule) from None
    violations = plugins.check_config(config)
    if violations:
        v = violations[0]
        more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
        raise ConfigError(config.source, v.key, f"refused by compliance: {v.rule}{more}")


def check_runner_options(source: str, model: str, runner: type, options: dict) -> None:
    """The options a runner class declares (`dynbatchd.devices.runners.check_options`), as a ConfigError."""
    from dynbatchd.devices.runners import check_options   # numpy only: no model library

    try:
        check_options(runner, dict(options))
    except ValueError as exc:   # OptionError names the option; another ValueError only the table
        option, rule = getattr(exc, "option", None), getattr(exc, "rule", str(exc))
        raise ConfigError(source, f"models.{model}.options" + (f".{option}" if option else ""), rule) from None
