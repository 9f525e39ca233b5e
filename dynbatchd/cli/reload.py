"""Config commands of dynbatchctl: `reload` (what changes, each channel's risk verdict), `check-config`
(a file as the daemon would load it, and with --risk what a reload to it would change), `config`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from dynbatchd import config as cfgmod
from dynbatchd.cli.output import JsonOption, control, emit_json, fail, out
from dynbatchd.cli.views import _value_text


ForceOption = typer.Option(False, "--force", help="Apply the change even if the risk assessment refuses "
                                                  "it (the daemon logs that it was forced).")
DryRunOption = typer.Option(False, "--dry-run", help="Print what would change and the risk verdict; "
                                                     "change nothing.")


def reload(ctx: typer.Context, force: bool = ForceOption, dry_run: bool = DryRunOption,
           as_json: bool = typer.Option(False, "--json", help='Print {"needs_restart": [...], "changes": ..., '
                                                              '"risk": ...}.')) -> None:
    """Re-read the daemon's config file (same as SIGHUP), with the tuning drop-in on top; a refused
    file, or a risky one without --force, leaves the running configuration as it is."""
    data = control(ctx, "reload", **({"force": True} if force else {}), **({"dry_run": True} if dry_run else {}))
    if as_json:
        emit_json(data)
        return
    print_plan(data)
    pending = data["needs_restart"]
    word = "reloaded" if data.get("applied", True) else "dry run, nothing changed"
    out.print(word + (f"; restart needed to change: {', '.join(pending)}" if pending else ""), highlight=False)


def print_plan(data: dict[str, Any]) -> None:
    """What a reload (or a checked file) changes, each channel's risk verdict, the overrides it drops."""
    for word in ("added", "removed"):
        for kind, names in (data.get(word) or {}).items():
            for name in names:
                out.print(f"{kind[:-1]} {name} {word}", highlight=False, markup=False)
    for channel, keys in (data.get("changes") or {}).items():
        changed = ", ".join(f"{k} {_value_text(a)} -> {_value_text(b)}" for k, (a, b) in keys.items())
        out.print(f"channel {channel}: {changed}", highlight=False, markup=False)
        verdict = (data.get("risk") or {}).get(channel)
        if verdict:
            word = ("risk accepted" if verdict["accepted"] else "RISK REFUSED") if verdict.get("assessed", True) \
                else "risk"
            out.print(f"  {word}: {verdict['reason']}", highlight=False, markup=False)
    for key in data.get("dropped_overrides") or ():
        out.print(f"override of {key} dropped: the config file changed it", highlight=False, markup=False)


def check_config(ctx: typer.Context,
                 path: Optional[Path] = typer.Argument(None, help="Config file (default: the one the daemon "
                                                                  "reads, from the search order)."),
                 risk: bool = typer.Option(False, "--risk", help="Also ask the running daemon for the risk of "
                                           "the channel changes this file makes, on its observed traffic."),
                 as_json: bool = JsonOption) -> None:
    """Check a config file as the daemon would load it; with --risk, what a reload to it would change
    and the risk verdict of each change (nothing is changed). Exits 1 when the risk is refused."""
    from dynbatchd.plugins import Plugins
    from dynbatchd.validation import validate_config

    found = cfgmod.find_config(path or ctx.obj.config)
    if found is None:
        raise fail(f"no config file found (searched {cfgmod.search_order_text()})", 2)
    try:
        cfg = cfgmod.load(found)
        validate_config(cfg, Plugins.load())
    except cfgmod.ConfigError as exc:
        raise fail(str(exc), 2) from None
    data: dict[str, Any] = {"file": str(found), "ok": True}
    if risk:
        raw = cfgmod.to_dict(cfg)
        raw.pop("source", None)
        data.update(control(ctx, "reload", dry_run=True, config=raw))
    refused = [ch for ch, v in (data.get("risk") or {}).items() if not v["accepted"]]
    if as_json:
        emit_json(data)
    else:
        out.print(f"ok {found}: {len(cfg.channels)} channels, {len(cfg.models)} models", highlight=False, markup=False)
        if risk:
            print_plan(data)
            if not data.get("changes"):
                out.print("no channel setting differs from what the daemon runs", highlight=False)
    if refused:
        raise typer.Exit(1)


def show_config(ctx: typer.Context) -> None:
    """Print the configuration the daemon runs with, as JSON."""
    emit_json(control(ctx, "config"))
