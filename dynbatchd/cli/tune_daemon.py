"""What `dynbatchctl tune` and its loop share: the daemon's control calls, its running config, and
the tuning history (the database beside the daemon's state)."""

from __future__ import annotations

from typing import Any

import typer
from rich.markup import escape

from dynbatchd import config as cfgmod
from dynbatchd.cli.output import control, err, fail
from dynbatchd.tuning import history
from dynbatchd.tuning.store import connect, database_path

LOOP_KEYS = ("max_batch", "window_ms", "window")   # what the loop changes, and what a rollback restores


def _call(ctx: typer.Context, cmd: str, **args: Any) -> Any:
    return control(ctx, cmd, **args)


def _channel_now(ctx: typer.Context, channel: str) -> dict[str, Any] | None:
    """The channel's running loop settings for the history, or None, quietly: not knowing them
    never stops a tune (nor adds a line to its error, e.g. the refusal of an admin's command)."""
    ctx.obj.curve_args(ctx.obj.control)   # a key that will not load: its one line, here
    try:
        found = ctx.obj.call("config").get("channels", {}).get(channel)
    except Exception:   # noqa: BLE001 - only the history's "before" is lost
        return None
    return _loop_settings(found) if found else None


def _database(ctx: typer.Context):
    """The tuning database of this host's config (``[daemon] state_dir``)."""
    path = cfgmod.find_config(ctx.obj.config)
    try:
        daemon = cfgmod.load(path).daemon if path is not None else cfgmod.DaemonSettings()
        return connect(database_path(daemon))
    except cfgmod.ConfigError as exc:
        raise fail(str(exc), 2) from None
    except OSError as exc:
        raise fail(f"the tuning database: {exc.strerror or exc}", 1) from None


def _running(ctx: typer.Context) -> cfgmod.Config:
    raw = _call(ctx, "config")
    raw.pop("source", None)
    return cfgmod.parse(raw, "running config")


def _loop_settings(channel: dict[str, Any]) -> dict[str, Any]:
    return {k: channel.get(k) for k in LOOP_KEYS}


def _note(ctx: typer.Context, channel: str, step: str, reason: str, **kw: Any) -> None:
    """Record a step; a history that cannot be written is a warning, never a lost tune."""
    try:
        with _database(ctx) as db:
            history.record(db, channel, step, reason, **kw)
    except (typer.Exit, OSError, Exception) as exc:   # noqa: BLE001 - the tune itself has happened
        err.print(f"[yellow]warning:[/yellow] not recorded in the tuning history: {escape(str(exc))}", highlight=False, soft_wrap=True)
