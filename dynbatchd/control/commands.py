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


CANARY_KEYS = ("max_batch", "window_ms", "window")   # what a canary may try: what the tuning loop changes


def canary(daemon, action: str = "status", channel: str | None = None, share: float = 0.1,
           seconds: float = 60.0, shadow: bool = False, **changes: Any) -> dict[str, Any]:
    """`canary [action=status]` -> {"running": {channel: figures}, "ended": {channel: verdict}};
    `canary action=start channel=NAME [max_batch=N] [window_ms=F] [window={...}] [share=0.1]
    [seconds=60] [shadow=false]` runs the changes on `share` of the channel's live traffic in a
    twin channel NAME~canary (with `shadow`, on copies whose results are discarded) and promotes
    them (runtime only, as `tune`) or rolls back when the time is up, or early on too many misses;
    `canary action=stop channel=NAME` ends it now as a rollback. One canary at a time.
    """
    if action == "status":
        return daemon.canary_report()
    if action not in ("start", "stop"):
        raise CommandError(f"canary action is status, start or stop; not {action!r}")
    if channel not in daemon.config.channels:
        raise CommandError(f"no channel named {channel!r}")
    if action == "stop":
        try:
            return daemon.stop_canary(channel)
        except KeyError:
            raise CommandError(f"no canary of channel {channel!r} is running") from None
    unknown = sorted(set(changes) - set(CANARY_KEYS))
    if unknown or not changes:
        raise CommandError(f"a canary tries {', '.join(CANARY_KEYS)}" + (f"; not {', '.join(unknown)}" if unknown else ""))
    if not isinstance(share, (int, float)) or not 0 < share <= 0.5:
        raise CommandError("share is above 0 and at most 0.5 (the incumbent keeps most of the traffic)")
    if not isinstance(seconds, (int, float)) or not 1 <= seconds <= 86_400:
        raise CommandError("seconds is between 1 and 86400")
    if daemon.state != "serving":
        raise CommandError(f"the daemon is {daemon.state}: a canary needs live traffic")
    try:
        return daemon.start_canary(channel, changes, float(share), float(seconds), bool(shadow))
    except ConfigError as exc:
        raise CommandError(f"refused: {exc.key}: {exc.rule}") from None
    except ValueError as exc:   # one already runs, or the last one's twin is still draining
        raise CommandError(str(exc)) from None


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
    "tune": tune, "canary": canary, "reload": reload, "warmup": warmup, "stop": stop,
}

# What a CURVE client key (keys_dir/clients/) may ask: reading the daemon's state. Everything
# else changes or stops it, or (`config`) shows how it is set up (key paths, tenants, endpoints),
# and needs an admin key (keys_dir/admins/). An ipc:// control socket has no keys: its file's
# permissions admit its user and group only, as admins.
OPEN_TO_CLIENTS = ("ping", "status", "plugins")


def needs_admin(cmd: str, args: dict[str, Any]) -> bool:
    """Whether `cmd` with `args` is an admin's: all but OPEN_TO_CLIENTS and `canary` status."""
    if cmd == "canary":
        return args.get("action", "status") != "status"
    return cmd not in OPEN_TO_CLIENTS


def for_client(cmd: str, result: Any) -> Any:
    """What a client key sees of a result: `status` without the compliance audit, whose latest
    decisions name other tenants and their request ids."""
    if cmd == "status" and isinstance(result, dict):
        return {k: v for k, v in result.items() if k != "compliance"}
    return result
