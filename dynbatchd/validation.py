"""Checks a configuration must pass beyond its structure, at load, reload and tune.

Structure (types, ranges, unknown keys, references) is `dynbatchd.config`'s
job; this module adds what needs the plugins: known runners (with the options
each declares) and policies (with their options), the tables plugins own
(`dynbatchd_config_tables`: ``[plugins.NAME]``, and the HTTP plugin's ``[http]``), and every compliance rule. Errors
arrive typed (`dynbatchd.errors.OptionError`: key, rule) and leave as ConfigError.
Nothing here builds a runner, so no model library (torch) is imported. With
``[daemon] curve`` on, the daemon's key files are read too (`check_curve`).
"""

from __future__ import annotations

import stat
from pathlib import Path

from dynbatchd import config as cfgmod
from dynbatchd.config import Config, ConfigError
from dynbatchd.errors import OptionError
from dynbatchd.plugins import Plugins
from dynbatchd.scheduler import build_channels


def validate_config(config: Config, plugins: Plugins) -> None:
    """Raise ConfigError (file, key, rule) for the first problem found."""
    plugins.check_tables(config)   # tables plugins own ([http], [plugins.NAME]): before the key files
    check_curve(config)
    runners = plugins.runners()
    for name, model in config.models.items():
        if model.runner not in runners:
            raise ConfigError(config.source, f"models.{name}.runner",
                              f"unknown runner {model.runner!r} (known: {', '.join(sorted(runners))})")
        check_runner_options(config.source, name, runners[model.runner], model.options)
    try:
        build_channels(config.channels, plugins.window_policies(), plugins.batch_sizers())
    except OptionError as exc:   # the built-in policies and the scheduler name the key: exc.key, exc.rule
        raise ConfigError(config.source, exc.key, exc.rule) from None
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(config.source, *_third_party_policy_error(exc)) from None
    policies = plugins.cache_policies()
    if config.cache.policy not in policies:
        raise ConfigError(config.source, "cache.policy",
                          f"unknown cache policy {config.cache.policy!r} (known: {', '.join(sorted(policies))})")
    violations = plugins.check_config(config)
    if violations:
        v = violations[0]
        more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
        raise ConfigError(config.source, v.key, f"refused by compliance: {v.rule}{more}")


def _third_party_policy_error(exc: Exception) -> tuple[str, str]:
    """(key, rule) of an error a third-party policy raised as a plain ValueError or TypeError: its
    text, split at the key when it starts with one (``channels.X.window.options.alpha: must be ...``,
    the form `dynbatchd.errors.OptionError` writes); else the whole text under ``channels``."""
    key, sep, rule = str(exc).partition(": ")
    if sep and key.startswith("channels."):
        return key, rule
    return "channels", f"policy options rejected: {exc}"


def check_runner_options(source: str, model: str, runner: type, options: dict) -> None:
    """The options a runner class declares (`dynbatchd.devices.runners.check_options`), as a ConfigError."""
    from dynbatchd.devices.runners import check_options   # numpy only: no model library

    try:
        check_options(runner, dict(options))
    except OptionError as exc:
        raise ConfigError.of_option(source, f"models.{model}.options", exc) from None
    except ValueError as exc:   # a third-party runner's check: it names only the table
        raise ConfigError(source, f"models.{model}.options", str(exc)) from None


def check_curve(config: Config) -> None:
    """With curve on: the key files the daemon will need for its tcp:// sockets, readable and valid.

    The server's key pair (KEYS_DIR/server.key_secret, mode 0600), the directory of admitted
    client keys (KEYS_DIR/clients/*.key) and, if present, of admin keys (KEYS_DIR/admins/*.key);
    an empty directory admits no one, which is allowed (keys may be added before clients come).
    Neither directory (nor KEYS_DIR) may be writable by its group or others: whoever can write
    there could admit a key of their own.
    """
    import zmq

    daemon = config.daemon
    if not cfgmod.curve_endpoints(daemon):
        return
    if not zmq.has("curve"):
        raise ConfigError(config.source, "daemon.curve", "this libzmq was built without CURVE support")
    try:
        cfgmod.read_key_file(cfgmod.server_secret_key_file(daemon), secret=True)
    except cfgmod.KeyFileError as exc:
        raise ConfigError(config.source, "daemon.keys_dir",
                          f"the server key pair: {exc} (make one: dynbatchctl keygen server --dir "
                          f"{daemon.keys_dir})") from None
    clients, admins = cfgmod.client_keys_dir(daemon), cfgmod.admin_keys_dir(daemon)
    if not clients.is_dir():
        raise ConfigError(config.source, "daemon.keys_dir",
                          f"{clients} is not a directory: it holds the public keys (NAME.key) of the "
                          "clients the daemon admits")
    if admins.exists() and not admins.is_dir():
        raise ConfigError(config.source, "daemon.keys_dir",
                          f"{admins} is not a directory: it holds the public keys (NAME.key) of the "
                          "admins, who may change and stop the daemon")
    for directory in (Path(daemon.keys_dir), clients, admins):
        if directory.is_dir() and cfgmod.writable_by_others(directory):
            mode = stat.S_IMODE(directory.stat().st_mode)
            raise ConfigError(config.source, "daemon.keys_dir",
                              f"{directory} is mode {mode:04o}: its group or others may write it, so they "
                              f"could admit a key of their own (chmod go-w {directory})")
    for directory, whose in ((clients, "a client"), (admins, "an admin")):
        for key_file in sorted(directory.glob("*.key")):
            try:
                cfgmod.read_key_file(key_file)
            except cfgmod.KeyFileError as exc:
                raise ConfigError(config.source, "daemon.keys_dir", f"{whose} key: {exc}") from None
