"""`dynbatchctl tune`: set a channel by hand, or let the tuning loop do it and keep the record.

By hand: ``tune CHANNEL --window-ms 20``. ``--auto [CHANNEL]``: the loop of
`dynbatchd.tuning`, one channel at a time: collect the daemon's observations
(refusing when they are too few), fit the channel's model, search settings on
the simulator (or take ``--candidate``), assess the risk on recent and burst
traffic, run a canary against the incumbent on a replay of the channel's
traffic, then promote or roll back. The canary runs in the daemon on a share
of the channel's live traffic (``--canary live``, the default), on copies of
it whose results are discarded (``--canary shadow``), or on the simulator
replaying the channel's traffic (``--canary replay``). A live canary that
the daemon judges bad is rolled back by the daemon itself, even if this
command is gone. ``--history`` shows every step. Every predicted figure (and
a replayed canary's) is SIMULATED.

Whatever changes a channel (a manual tune, a promotion) the daemon checks with
the same risk assessment (``--dry-run`` prints it and changes nothing,
``--force`` applies a refused change, logged as forced) and writes to its
tuning drop-in (STATE_DIR/overrides.toml), so it survives reload and restart;
``--rollback CHANNEL`` takes the last change back, one step at a time, down to
the config file's value.
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from dynbatchd import config as cfgmod
from dynbatchd.cli.output import emit_json as _emit, err, fail, out  # noqa: F401
from dynbatchd.cli.tables import WIDE_HELP
from dynbatchd.cli.tune_daemon import (LOOP_KEYS, _call, _channel_now, _database, _loop_settings,  # noqa: F401
                                       _note, _running)
from dynbatchd.cli.tune_generative import run_tune_generative
from dynbatchd.cli.tune_loop import canary_too_small, run_loop  # noqa: F401
from dynbatchd.tuning import history

TUNE_HELP = {
    "max_batch": "Largest batch cut from the channel (1 to 65536).",
    "window_ms": "Longest wait for a batch to fill, in ms (0 to the channel's deadline).",
    "deadline_ms": "Default deadline of the channel's requests, in ms (> 0, at most one day).",
    "queue_limit": "Requests the channel may hold before answering overloaded (1 to 16777216).",
    "max_tokens": "Cap on the tokens of one batch (0: none).",
    "min_share": "Share of recent device time the channel is guaranteed under overload (0 to 1).",
    "long_share": "Share of what first-come first-served would answer in time of the longest tenth of "
                  "requests that a size-ordered plan keeps for them (0 to 1; 0: off, most requests on time).",
}


def parse_candidate(text: str) -> dict[str, Any]:
    """``max_batch=64,window_ms=900[,policy=slo]`` -> a dict (one clear error otherwise)."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or key not in ("max_batch", "window_ms", "policy"):
            raise ValueError(f"--candidate takes max_batch=N,window_ms=F[,policy=NAME]; not {part!r}")
        out[key] = _candidate_value(key, value.strip())
    if "max_batch" not in out or "window_ms" not in out:
        raise ValueError("--candidate needs both max_batch and window_ms")
    return out


def _candidate_value(key: str, value: str) -> Any:
    """One --candidate value: max_batch a whole number, window_ms a finite number; ValueError naming the
    key (int()'s own message named neither the key nor the option)."""
    if key == "policy":
        return value
    try:
        number = int(value) if key == "max_batch" else float(value)
    except ValueError:
        number = None
    if number is None or not math.isfinite(number):
        kind = "a whole number" if key == "max_batch" else "a finite number of ms"
        raise ValueError(f"--candidate {key} is {kind}, not {value!r}")
    return number


def tune(ctx: typer.Context,
         channel: Optional[str] = typer.Argument(None, help="The channel (with --auto: only this one)."),
         max_batch: Optional[int] = typer.Option(None, help=TUNE_HELP["max_batch"]),
         window_ms: Optional[float] = typer.Option(None, help=TUNE_HELP["window_ms"]),
         deadline_ms: Optional[float] = typer.Option(None, help=TUNE_HELP["deadline_ms"]),
         queue_limit: Optional[int] = typer.Option(None, help=TUNE_HELP["queue_limit"]),
         max_tokens: Optional[int] = typer.Option(None, help=TUNE_HELP["max_tokens"]),
         min_share: Optional[float] = typer.Option(None, help=TUNE_HELP["min_share"]),
         long_share: Optional[float] = typer.Option(None, help=TUNE_HELP["long_share"]),
         auto: bool = typer.Option(False, "--auto", help="Run the tuning loop (collect, fit, search, risk, "
                                   "canary, promote or roll back) on CHANNEL, else on every busy channel."),
         candidate: Optional[str] = typer.Option(None, "--candidate", metavar="max_batch=N,window_ms=F",
                                                 help="With --auto: assess and canary this setting instead "
                                                      "of searching (e.g. to test the safeguards); max_batch "
                                                      "a whole number, window_ms a finite number."),
         trials: int = typer.Option(30, "--trials", min=1, help="With --auto: simulated settings to try."),
         duration: float = typer.Option(20.0, "--duration", min=1.0,
                                        help="With --auto: seconds of the channel's traffic each trial replays."),
         target: float = typer.Option(0.99, "--target", min=0.0, max=1.0,
                                      help="With --auto: the on-time share a setting must keep (the SLO)."),
         risk_threshold: float = typer.Option(0.02, "--risk-threshold", min=0.0, max=1.0,
                                              help="With --auto: on-time share a candidate may lose to the "
                                                   "incumbent on x1.5 / x2 bursts before it is refused."),
         canary_share: float = typer.Option(0.1, "--canary-share", min=0.01, max=0.5,
                                            help="With --auto: share of the channel's traffic the candidate serves."),
         canary_seconds: float = typer.Option(10.0, "--canary-seconds", min=1.0,
                                              help="With --auto: how long the canary runs."),
         canary_mode: str = typer.Option("live", "--canary", metavar="live|shadow|replay",
                                         help="With --auto: the candidate serves its share of the live "
                                              "traffic (live), runs copies of it whose results are "
                                              "discarded (shadow), or is judged on a SIMULATED replay."),
         seed: int = typer.Option(1, "--seed", help="With --auto: random seed (the loop is deterministic)."),
         window: float = typer.Option(10.0, "--window", min=0.0,
                                      help="With --auto: seconds of live traffic to observe (status read at "
                                           "its start and end; 0: the daemon's rate meter)."),
         show_history: bool = typer.Option(False, "--history", help="Show the tuning history (of CHANNEL, "
                                           "else of all) instead of changing anything."),
         rollback: bool = typer.Option(False, "--rollback", help="Take back CHANNEL's last change (manual or "
                                       "promoted): one step back, down to the config file's value."),
         force: bool = typer.Option(False, "--force", help="Apply a setting even if the risk assessment refuses "
                                    "it (the daemon logs that it was forced)."),
         dry_run: bool = typer.Option(False, "--dry-run", help="Print what the setting would change and the "
                                      "risk verdict; change nothing."),
         generative: bool = typer.Option(False, "--generative",
                                         help="Offline, from the config: recommend the causal-lm model's "
                                              "max_batch_sequences and max_prefill_tokens for CHANNEL's TTFT/TPOT "
                                              "targets by simulation; changes nothing."),
         rate: float = typer.Option(5.0, "--rate", min=0.001,
                                    help="With --generative: offered requests per second."),
         wide: bool = typer.Option(False, "--wide", help=WIDE_HELP),
         as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts instead of text.")) -> None:
    """Change a channel's batching at run time, or tune it with --auto (checked like a config file
    and by the risk assessment; kept in the daemon's tuning drop-in across reload and restart).

    \b
    Examples:
      dynbatchctl tune realtime --window-ms 20 --max-batch 8
      dynbatchctl tune realtime --window-ms 20 --dry-run
      dynbatchctl tune --auto standard
      dynbatchctl tune --auto standard --candidate max_batch=64,window_ms=900
      dynbatchctl tune --history
      dynbatchctl tune --rollback standard
      dynbatchctl tune chat --generative --rate 10
    """
    changes = {k: v for k, v in dict(max_batch=max_batch, window_ms=window_ms, deadline_ms=deadline_ms,
                                      queue_limit=queue_limit, max_tokens=max_tokens, min_share=min_share,
                                      long_share=long_share).items()
               if v is not None}
    modes = [m for m, on in (("--auto", auto), ("--history", show_history), ("--rollback", rollback),
                             ("a setting", bool(changes))) if on]
    if len(modes) > 1:
        raise fail(f"give one of --auto, --history, --rollback or settings; not {' and '.join(modes)}", 2)
    if generative:
        if channel is None or modes:
            raise fail("--generative takes a CHANNEL and no other mode, e.g. dynbatchctl tune chat --generative", 2)
        return run_tune_generative(ctx, channel, rate, duration, seed, as_json)
    if show_history:
        return _show_history(ctx, channel, as_json)
    if channel is None and not auto:
        raise fail("name the channel, e.g. dynbatchctl tune standard --window-ms 20", 2)
    if rollback:
        return _rollback(ctx, channel, as_json)
    if auto:
        try:
            wanted = parse_candidate(candidate) if candidate else None
        except ValueError as exc:
            raise fail(str(exc), 2) from None
        if canary_mode not in ("live", "shadow", "replay"):
            raise fail(f"--canary is live, shadow or replay; not {canary_mode!r}", 2)
        return run_loop(ctx, channel, wanted, dict(trials=trials, duration=duration, target=target,
                                                    threshold=risk_threshold, share=canary_share,
                                                    seconds=canary_seconds, seed=seed, window=window,
                                                    canary=canary_mode, wide=wide), as_json)
    if not changes:
        raise fail("give at least one setting, e.g. --window-ms 20 (or --auto, --history, --rollback)", 2)
    try:   # the ranges of a config file, here, so a value msgpack cannot even carry is one clear line
        cfgmod.check_channel_values(channel, changes)
    except cfgmod.ConfigError as exc:
        raise fail(f"refused: {exc.key}: {exc.rule}", 2) from None
    if dry_run:
        return _dry_run(ctx, channel, changes, as_json)
    before = _channel_now(ctx, channel)
    data = _call(ctx, "tune", channel=channel, **changes, **({"force": True} if force else {}))
    settings = data.get("settings", data)   # (a daemon before the drop-in answered the settings alone)
    _note(ctx, channel, "manual", "set by hand: " + ", ".join(f"{k}={v}" for k, v in changes.items()),
          before=before, after=_loop_settings(settings))
    if as_json:   # the channel's settings at the top, as before the drop-in, and what the daemon said
        _emit({**settings, **{k: v for k, v in data.items() if k != "settings"}})
        return
    out.print(f"channel [bold]{escape(channel)}[/bold] now: " + ", ".join(f"{k}={settings[k]}" for k in changes),
              highlight=False)
    if data.get("verdict"):
        out.print(("[yellow]FORCED[/yellow] past the risk assessment: " if data.get("forced") else "risk: ")
                  + escape(data["verdict"]), highlight=False)


def _dry_run(ctx: typer.Context, channel: str, changes: dict[str, Any], as_json: bool) -> None:
    """`tune CHANNEL ... --dry-run`: the daemon's plan and risk verdict; nothing changes. Exit 1 when refused."""
    data = _call(ctx, "tune", channel=channel, dry_run=True, **changes)
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    else:
        out.print(f"channel [bold]{escape(channel)}[/bold] would change: " + ", ".join(
            f"{k} {data['before'].get(k)} -> {v}" for k, v in data["after"].items()) + " (dry run: nothing changed)",
            highlight=False)
        out.print(f"risk {escape(data['verdict'])}", highlight=False)
    if not data["risk"]["accepted"]:
        raise typer.Exit(1)


def _show_history(ctx: typer.Context, channel: str | None, as_json: bool) -> None:
    with _database(ctx) as db:
        steps = history.rows(db, channel)
    if as_json:
        sys.stdout.write(json.dumps(steps, indent=2, default=str) + "\n")
        return
    if not steps:
        out.print("no tuning steps recorded" + (f" for channel {escape(channel)}" if channel else ""), highlight=False)
        return
    table = Table(title="tuning history (predicted and canary figures SIMULATED)")
    for col in ("when (UTC)", "channel", "step", "settings", "reason"):
        table.add_column(col, overflow="fold")
    for s in steps:
        settings = s["after"] or (s["figures"] or {}).get("candidate_settings") or {}
        shown = ", ".join(f"{k}={v}" for k, v in settings.items() if v is not None)
        table.add_row(time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(s["at"])), s["channel"], s["step"], shown,
                      s["reason"])
    out.print(table)


def _rollback(ctx: typer.Context, channel: str, as_json: bool) -> None:
    """One step back, by the daemon from its drop-in (which knows every change, whoever made it)."""
    before = _channel_now(ctx, channel)
    data = _call(ctx, "tune", channel=channel, rollback=True)
    settings = data.get("settings", data)
    _note(ctx, channel, "restore", "restored by tune --rollback", before=before, after=_loop_settings(settings))
    if as_json:
        _emit({**settings, **{k: v for k, v in data.items() if k != "settings"}})
    else:
        restored = data.get("after") or {k: settings.get(k) for k in LOOP_KEYS}
        out.print(f"channel [bold]{escape(channel)}[/bold] restored: "
                  + ", ".join(f"{k}={v}" for k, v in restored.items()), highlight=False)


