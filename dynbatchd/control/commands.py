"""Control commands, one function each: the docstring is the command's contract.

Each takes the running daemon and keyword arguments from the request's
``args`` and returns plain data (the reply's ``result``), or raises
`CommandError` with one clear line. A command that must wait (the risk
assessment of a change runs its simulations off the event loop) returns a
coroutine instead, which the server awaits before it replies. The commands of
`TAKES_PEER` get ``by``: the CURVE key name of the sender, else "local"
(whatever the request's args say), for the log and the tuning drop-in.
"""

from __future__ import annotations

import inspect
from typing import Any, Awaitable, Callable

import msgspec

from dynbatchd import config as cfgmod
from dynbatchd.config import ConfigError
from dynbatchd.errors import DynbatchdError
from dynbatchd.overrides import TUNABLE
from dynbatchd.protocol import MAX_TENANT_CHARS


class CommandError(DynbatchdError):
    pass


def _shown(value: Any) -> str:
    """`value` as an error message quotes it: short, whatever a client sent."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def flag(name: str, value: Any) -> bool:
    """Argument `name` as true or false: a boolean only, so that a string such as "no" is refused
    rather than read as true."""
    if not isinstance(value, bool):
        raise CommandError(f"{name} is true or false, not {_shown(value)}")
    return value


def count(name: str, value: Any, least: int = 0) -> int:
    """Argument `name` as a whole number >= `least` (a boolean is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise CommandError(f"{name} is a whole number >= {least}, not {_shown(value)}")
    return value


def _number(value: Any) -> bool:
    """An int or a float, not a boolean (`seconds=true` was a one-second canary)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


WHY_CHARS = 500   # a change's reason, kept in the overrides file's history and logged: a note, not a document


def reason(value: Any) -> str:
    """A change's `why`: text of at most WHY_CHARS characters (it is written to the overrides file
    and the log, so a client cannot make either hold its megabytes)."""
    if not isinstance(value, str) or len(value) > WHY_CHARS:
        raise CommandError(f"why is text of at most {WHY_CHARS} characters, not {_shown(value)}")
    return value


WINDOW_VALUES = 256   # values in a `window` table: a policy's options are a few numbers and short lists


def _values_in(value: Any, limit: int) -> int:
    """How many values `value` holds, its tables and lists counted with what they hold; counting stops
    past `limit`."""
    seen, stack = 0, [value]
    while stack and seen <= limit:
        item = stack.pop()
        seen += 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return seen


def window_table(changes: dict[str, Any]) -> None:
    """A `window` change of at most WINDOW_VALUES values: a policy builds from its options at once, on
    the event loop (a bandit's 6,000 windows x 6,000 caps took it 32 s, a dry run included)."""
    if "window" in changes and _values_in(changes["window"], WINDOW_VALUES) > WINDOW_VALUES:
        raise CommandError(f"window is a policy and its options, at most {WINDOW_VALUES} values in all; "
                           "not a larger table")


def ping(daemon) -> dict[str, Any]:
    """`ping` -> {"state": "serving" | "starting" | "draining"}."""
    return {"state": daemon.state}


def status(daemon) -> dict[str, Any]:
    """`status` -> {"daemon": {...}, "channels": {name: {...}}, "devices": [{...}]} (see dynbatchctl(1))."""
    return daemon.operations.status()


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
    """`config` -> the configuration the daemon is running with (after tune/reload), its tables as
    a file spells them; what a plugin owns at the top level (``[http]``, and its keys of
    ``[routing]``, ``[compliance]``, ``[cache]``) with its defaults filled in, as the plugin runs it."""
    shown = cfgmod.to_dict(daemon.config)
    for name, owned in daemon.plugins.config_tables().items():
        key = getattr(owned, "table_key", "")
        if key:   # over the core's keys of a shared table, beside them
            shown[key] = {**shown.get(key, {}), **msgspec.to_builtins(daemon.plugins.table(daemon.config, name))}
    return shown


TAKES_PEER = ("tune", "canary", "reload", "forget")
FORCE_HINT = "(--force applies it anyway, and the daemon logs that it was forced)"


def _risk_refusal(exc: Exception) -> CommandError:
    return CommandError(f"refused by the risk assessment: {exc} {FORCE_HINT}")


async def _settled(pending: Awaitable[Any], shape: Callable[[Any], Any] = lambda r: r) -> Any:
    """Await a daemon operation, its known failures as one CommandError line."""
    from dynbatchd.operations import RiskRefused

    try:
        return shape(await pending)
    except ConfigError as exc:
        raise CommandError(f"refused: {exc.key}: {exc.rule}" if exc.key else f"refused: {exc}") from None
    except RiskRefused as exc:
        raise _risk_refusal(exc) from None
    except OSError as exc:
        raise CommandError(f"the tuning drop-in could not be written: {exc}") from None


def tune(daemon, channel: str, by: str = "local", force: bool = False, dry_run: bool = False,
         rollback: bool = False, why: str = "", **changes: Any) -> Any:
    """`tune channel=NAME [max_batch=N] [window_ms=F] ... [force=false] [dry_run=false] [why=TEXT]`
    -> {"channel", "before", "after", "risk", "verdict", "applied", "settings"}.

    Changes one channel at run time, checked by the same rules (and compliance plugins) as a
    config file and by the risk assessment, which refuses a risky change unless `force`. The
    change is written to the tuning drop-in (STATE_DIR/overrides.toml), so it survives reload and
    restart. `dry_run`: the plan and the verdict, nothing changed. `tune channel=NAME
    rollback=true`: one step back (the value before the last change; the config file's when no
    earlier change is left).
    """
    force, dry_run, rollback = flag("force", force), flag("dry_run", dry_run), flag("rollback", rollback)
    why = reason(why)
    if channel not in daemon.config.channels:
        raise CommandError(f"no channel named {_shown(channel)}")
    if rollback:
        if changes:
            raise CommandError("rollback takes no settings")
        try:
            return daemon.operations.rollback(channel, by=by)
        except LookupError:
            raise CommandError(f"no change of channel {channel!r} to roll back; nothing to restore "
                               "(it runs as the config file says)") from None
        except (ConfigError, OSError) as exc:
            raise CommandError(f"rollback refused: {exc}") from None
    unknown = sorted(set(changes) - set(TUNABLE))
    if unknown or not changes:
        raise CommandError(f"tunable settings are {', '.join(TUNABLE)}" + (f"; not {', '.join(unknown)}" if unknown else ""))
    window_table(changes)
    try:
        cfgmod.with_channel(daemon.config, channel, **changes)   # the value's own rules, at once
    except ConfigError as exc:
        raise CommandError(f"refused: {exc.key}: {exc.rule}") from None
    return _settled(daemon.operations.tune(channel, changes, by=by, why=why, force=force, dry_run=dry_run))


CANARY_KEYS = ("max_batch", "window_ms", "window")   # what a canary may try: what the tuning loop changes


def canary(daemon, action: str = "status", channel: str | None = None, share: float = 0.1,
           seconds: float = 60.0, shadow: bool = False, by: str = "local", force: bool = False,
           **changes: Any) -> Any:
    """`canary [action=status]` -> {"running": {channel: figures}, "ended": {channel: verdict}};
    `canary action=start channel=NAME [max_batch=N] [window_ms=F] [window={...}] [share=0.1]
    [seconds=60] [shadow=false]` runs the changes on `share` of the channel's live traffic in a
    twin channel NAME~canary (with `shadow`, on copies whose results are discarded) and promotes
    them (as `tune` does: into the tuning drop-in) or rolls back when the time is up, or early on
    too many misses; the risk assessment runs first and refuses a risky candidate unless
    `force=true`. `canary action=stop channel=NAME` ends it now as a rollback. One canary at a time.
    """
    if action == "status":
        return daemon.canary.report()
    shadow, force = flag("shadow", shadow), flag("force", force)
    if action not in ("start", "stop"):
        raise CommandError(f"canary action is status, start or stop; not {action!r}")
    if channel not in daemon.config.channels:
        raise CommandError(f"no channel named {_shown(channel)}")
    if action == "stop":
        try:
            return daemon.canary.stop(channel)
        except KeyError:
            raise CommandError(f"no canary of channel {channel!r} is running") from None
    unknown = sorted(set(changes) - set(CANARY_KEYS))
    if unknown or not changes:
        raise CommandError(f"a canary tries {', '.join(CANARY_KEYS)}" + (f"; not {', '.join(unknown)}" if unknown else ""))
    window_table(changes)
    if not _number(share) or not 0 < share <= 0.5:
        raise CommandError(f"share is above 0 and at most 0.5 (the incumbent keeps most of the traffic), "
                           f"not {_shown(share)}")
    if not _number(seconds) or not 1 <= seconds <= 86_400:
        raise CommandError(f"seconds is between 1 and 86400, not {_shown(seconds)}")
    if daemon.state != "serving":
        raise CommandError(f"the daemon is {daemon.state}: a canary needs live traffic")
    try:
        cfgmod.with_channel(daemon.config, channel, **changes)   # the value's own rules, at once
    except ConfigError as exc:
        raise CommandError(f"refused: {exc.key}: {exc.rule}") from None
    return _start_canary(daemon, channel, changes, float(share), float(seconds), shadow, by, force)


async def _start_canary(daemon, channel: str, changes: dict[str, Any], share: float, seconds: float,
                        shadow: bool, by: str, force: bool) -> dict[str, Any]:
    try:
        return await _settled(daemon.canary.start_checked(channel, changes, share, seconds, shadow, by=by,
                                                          force=force))
    except ValueError as exc:   # one already runs, or the last one's twin is still draining
        raise CommandError(str(exc)) from None


def reload(daemon, by: str | None = None, force: bool = False, dry_run: bool = False,
           config: dict[str, Any] | None = None) -> Any:
    """`reload [force=false] [dry_run=false] [config={...}]` -> {"needs_restart": [...], "changes":
    {channel: {key: [before, after]}}, "added": {"channels": [...], "models": [...]}, "removed":
    {...}, "risk": {channel: verdict}, "dropped_overrides": [...], "applied"}: re-read the config
    file (same as SIGHUP) with the tuning drop-in on top; a key the file changed drops its
    override. Channels and models are added and removed live: an added channel is routable at
    once, a removed one answers what it holds and then goes; an added model is refused
    unknown_model until a worker has loaded it (status: models.loading), a removed one is refused
    at once and unloaded once its accepted requests are answered. `needs_restart` names what only
    a restart changes (daemon, devices, cache; a model's settings; models on a Ray pool). Every
    channel it changes is risk-assessed, and a risky reload is refused unless `force`. `dry_run`:
    only the plan (`config`: check that configuration, a table as a TOML file spells it, e.g. the
    file an operator is about to install, read by dynbatchctl check-config --risk, instead of the
    daemon's own file). `force` and `dry_run` are booleans.
    """
    force, dry_run = flag("force", force), flag("dry_run", dry_run)
    opts = {k: v for k, v in (("by", by), ("force", force), ("dry_run", dry_run)) if v}
    try:
        if config is not None:
            if not dry_run:
                raise CommandError("config= is for dry_run=true only: a reload reads the daemon's own file")
            if not isinstance(config, dict):
                raise CommandError(f"config is a configuration table (a map of the file's tables, as "
                                   f"dynbatchctl check-config --risk sends it), not {_shown(config)}")
            opts["config"] = cfgmod.parse(config, "check-config")
        pending = daemon.operations.reload(**opts)
    except ConfigError as exc:
        raise CommandError(f"reload refused, running configuration kept: {exc}") from None
    if not inspect.isawaitable(pending):   # a daemon whose reload does not wait
        return {"needs_restart": pending}
    return _reload(pending)


async def _reload(pending: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    from dynbatchd.operations import RiskRefused

    try:
        return await pending
    except ConfigError as exc:
        raise CommandError(f"reload refused, running configuration kept: {exc}") from None
    except RiskRefused as exc:
        raise CommandError(f"reload refused, running configuration kept: {_risk_refusal(exc)}") from None


def warmup(daemon, top_users: int = 10_000, model: str | None = None) -> dict[str, Any]:
    """`warmup [top_users=N] [model=NAME]` -> {"queued", "already_cached", "backlog"}.

    Asks the warmup plugins which inputs the top users will send and
    precomputes them into the result cache through ``[cache] warmup_channel``
    (else the default channel), on idle devices only. Needs ``[cache] entries > 0``.
    """
    if daemon.cache is None:
        raise CommandError("the result cache is off: set [cache] entries in the config to use warmup")
    top_users = count("top_users", top_users, least=1)
    if model is not None and model not in daemon.config.models:
        raise CommandError(f"no model named {_shown(model)}")
    unready = daemon.membership.unready(model) if model is not None else None
    if unready:   # its batches would fail unseen, each input counted as warmed and nothing cached
        raise CommandError(f"{unready}: nothing to warm it up on")
    return daemon.cache_ops.warmup(model, top_users)


TENANT_CHARS = MAX_TENANT_CHARS   # `forget`'s tenant is written to the logs: a name, not megabytes (as at the door)


def forget(daemon, user: str, tenant: str | None = None, by: str = "local") -> dict[str, Any]:
    """`forget user=NAME [tenant=T]` -> {"sketch_users", "sketch_inputs", "cache_entries",
    "warmup_inputs", "file_rewritten"}: counts only.

    Erases the user (of every tenant, or of tenant T) from the top-users sketch and its saved
    file (rewritten at once), the result-cache entries of the inputs the sketch kept for them
    (looked up before the sketch forgets them), and those inputs from the warmup backlog. The
    audit log records the erasure with the user id's keyed hash, never the id or an input.
    """
    if not isinstance(user, str) or not user:
        raise CommandError("user is the user id to erase (a non-empty string)")
    if tenant is not None and (not isinstance(tenant, str) or len(tenant) > TENANT_CHARS):
        raise CommandError(f"tenant is a tenant name of at most {TENANT_CHARS} characters, not {_shown(tenant)} "
                           "(without tenant, the user is erased from every tenant)")
    return daemon.cache_ops.forget(user, tenant, by=by)


def stop(daemon) -> dict[str, Any]:
    """`stop` -> {"state": "draining"}: drain and exit (same as SIGTERM)."""
    daemon.operations.request_stop()
    return {"state": daemon.state}


COMMANDS: dict[str, Callable[..., Any]] = {
    "ping": ping, "status": status, "plugins": plugins, "config": config,
    "tune": tune, "canary": canary, "reload": reload, "warmup": warmup, "forget": forget, "stop": stop,
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
    decisions name other tenants and their request ids, nor the answers counted per tenant."""
    if cmd == "status" and isinstance(result, dict):
        return {k: v for k, v in result.items() if k not in ("compliance", "tenants")}
    return result
