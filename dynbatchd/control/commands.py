"""Control commands, one function each: the docstring is the command's contract.

Each takes the running daemon and keyword arguments from the request's
``args`` and returns plain data (the reply's ``result``), or raises
`CommandError` with one clear line.
"""

from __future__ import annotations

from typing import Any, Callable

from dynbatchd import config as cfgmod
from dynbatchd.config import ConfigError


class CommandError(Exception):
    pass


def ping(daemon) -> dict[str, Any]:
    """`ping` -> {"state": "serving" | "starting" | "draining"}."""
    return {"state": daemon.state}


def status(daemon) -> dict[str, Any]:
    """`status` -> {"daemon": {...}, "channels": {name: {...}}, "devices": [{...}]} (see dynbatchctl(1))."""
    return daemon.status()


def plugins(daemon) -> dict[str, Any]:
    """`plugins` -> {"loaded": [{name, module, hooks, source}], "broken": {name: error}, registries}."""
    p = daemon.plugins
    return {
        "loaded": [{"name": i.name, "module": i.module, "hooks": list(i.hooks), "source": i.source} for i in p.describe()],
        "broken": dict(p.broken),
        "runners": sorted(p.runners()),
        "window_policies": sorted(p.window_policies()),
        "batch_sizers": sorted(p.batch_sizers()),
    }


def config(daemon) -> dict[str, Any]:
    """`config` -> the configuration the daemon is running with (after tune/reload)."""
    return cfgmod.to_dict(daemon.config)


TUNABLE = ("max_batch", "window_ms", "deadline_ms", "queue_limit", "max_tokens", "min_share",
           "window")   # window: {"policy": NAME, "options": {...}} or None (fixed), as `tune --auto` sets it


def tune(daemon, channel: str, **changes: Any) -> dict[str, Any]:
    """`tune channel=NAME [max_batch=N] [window_ms=F] ...` -> the channel's new settings.

    Changes one channel at run time, checked by the same rules (and compliance
    plugins) as a config file. Not written back to disk: edit the file and
    reload to make it permanent.
    """
    if channel not in daemon.config.channels:
        raise CommandError(f"no channel named {channel!r}")
    unknown = sorted(set(changes) - set(TUNABLE))
    if unknown or not changes:
        raise CommandError(f"tunable settings are {', '.join(TUNABLE)}" + (f"; not {', '.join(unknown)}" if unknown else ""))
    try:
        new = cfgmod.with_channel(daemon.config, channel, **changes)
        daemon.apply_config(new)
    except ConfigError as exc:
        raise CommandError(f"refused: {exc.key}: {exc.rule}") from None
    return cfgmod.to_dict(daemon.config.channels[channel])


def reload(daemon) -> dict[str, Any]:
    """`reload` -> {"needs_restart": [...]}: re-read the config file (same as SIGHUP)."""
    try:
        return {"needs_restart": daemon.reload()}
    except ConfigError as exc:
        raise CommandError(f"reload refused, running configuration kept: {exc}") from None


def warmup(daemon, top_users: int = 10_000, model: str | None = None) -> dict[str, Any]:
    """`warmup [top_users=N] [model=NAME]` -> {"queued", "already_cached", "backlog"}.

    Asks the warmup plugins which inputs the top users will send and
    precomputes them into the result cache through the warmup channel (the
    bulk path), a little at a time. Needs ``[cache] entries > 0``.
    """
    if daemon.cache is None:
        raise CommandError("the result cache is off: set [cache] entries in the config to use warmup")
    if model is not None and model not in daemon.config.models:
        raise CommandError(f"no model named {model!r}")
    return daemon.warmup(model, int(top_users))


def stop(daemon) -> dict[str, Any]:
    """`stop` -> {"state": "draining"}: drain and exit (same as SIGTERM)."""
    daemon.request_stop()
    return {"state": daemon.state}


COMMANDS: dict[str, Callable[..., Any]] = {
    "ping": ping, "status": status, "plugins": plugins, "config": config,
    "tune": tune, "reload": reload, "warmup": warmup, "stop": stop,
}
