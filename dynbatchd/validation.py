"""Checks a configuration must pass beyond its structure, at load, reload and tune.

Structure (types, ranges, unknown keys, references) is `dynbatchd.config`'s
job; this module adds what needs the plugins: known runners and policies
(with their options), and every compliance rule.
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
    try:
        build_channels(config.channels, plugins.window_policies(), plugins.batch_sizers())
    except KeyError as exc:
        key, _, rule = str(exc.args[0]).partition(": ")
        raise ConfigError(config.source, key, rule) from None
    except (TypeError, ValueError) as exc:
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
