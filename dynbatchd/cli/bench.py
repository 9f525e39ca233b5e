"""`dynbatchctl bench`: the guide's test matrix, live against the daemon or --simulated on the engine.

Each cell's figures go to the configuration database (``STATE_DIR/tuning.sqlite``);
`--history` reads them back. Pictures (3-D scatter PNG + HTML, QPS-vs-load with
the knee) go to --out. Live, the channel is retuned per cell through the control
socket and its original settings are restored at the end, on an error and on
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from dynbatchd import config as cfgmod
from dynbatchd.cli import limits
from dynbatchd.cli.output import check_writable
from dynbatchd.cli.tables import WIDE_HELP, fit_table, show
from dynbatchd.client import DynbatchdError
from dynbatchd.tuning import bench as B
from dynbatchd.tuning import cells, plots
from dynbatchd.tuning.store import connect, database_path

out = Console()
err = Console(stderr=True, soft_wrap=True)


def fail(message: str, code: int) -> typer.Exit:
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False)
    return typer.Exit(code)


def _numbers(text: str | None, kind: type, name: str) -> list:
    if text is None:
        return []
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise fail(f"{name} {text!r}: a comma-separated list of numbers, e.g. {name} 50,100", 2) from None
    if not values or any(not v > 0 for v in values):
        raise fail(f"{name} {text!r}: every value must be above 0", 2)
    return [limits.check(name, v) for v in values]


def _load_config(ctx: typer.Context) -> tuple[cfgmod.Config, Path | None]:
    path = cfgmod.find_config(getattr(ctx.obj, "config", None))
    if path is None:
        raise fail(f"no config file found (searched {cfgmod.search_order_text()})", 2)
    try:
        return cfgmod.load(path), path
    except cfgmod.ConfigError as exc:
        raise fail(str(exc), 2) from None


def _history(db_path: Path, channel: str | None, model: str | None, as_json: bool, wide: bool = False) -> None:
    with connect(db_path) as db:
        rows = cells.query(db, channel=channel, model=model)
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2, default=str) + "\n")
        return
    if not rows:
        out.print(f"no bench cells recorded in {escape(str(db_path))}", highlight=False, soft_wrap=True)
        return
    _table(rows, f"bench history ({db_path})", history=True, wide=wide)


def _table(rows: list[dict[str, Any]], title: str, history: bool = False, wide: bool = False) -> None:
    """Cells as a table that fits the terminal (`wide`: every column); a history also says when and where
    each ran."""
    rank = {"when (UTC)": 1, "channel": 2, "kind": 0, "batch": 0, "window ms": 0, "load": 0, "QPS": 0, "p99 ms": 0,
            "on time": 0, "util": 3, "fill": 4}
    cols = (("when (UTC)", "channel", "kind", "batch", "window ms", "load", "QPS", "p99 ms", "on time") if history
            else ("kind", "batch", "window ms", "load", "QPS", "p99 ms", "on time", "util", "fill"))
    shown = []
    for r in rows:
        where = (time.strftime("%m-%d %H:%M", time.gmtime(r["at"])), r["channel"]) if history else ()
        tail = () if history else (
            "-" if r["device_utilisation"] is None else f"{100 * r['device_utilisation']:.0f}%",
            "-" if r["fill_rate"] is None else f"{r['fill_rate']:.2f}")
        shown.append([*where, "SIM" if r["simulated"] else "live", str(r["max_batch"]), f"{r['window_ms']:g}",
                      f"{r['load']:g}{'c' if r['load_kind'] == 'closed' else '/s'}", f"{r['qps']:.0f}",
                      "-" if r["p99_ms"] is None else f"{r['p99_ms']:.0f}",
                      "-" if r["on_time"] is None else f"{100 * r['on_time']:.1f}%", *tail])
    show(out, fit_table(title, [(c, rank[c]) for c in cols], shown, out, wide,
                        left={"when (UTC)", "kind", "channel"}), wide)
    out.print("load: Nc = N clients always waiting (closed loop), N/s = N requests per second (open loop); "
              "SIM = SIMULATED", highlight=False)


class _Stop(Exception):
    """SIGTERM during a live bench: unwind through the finally that restores the channel."""


def bench(ctx: typer.Context,
          channel: Optional[str] = typer.Option(None, "--channel",
                                                help="Channel to bench (default: the routing default). "
                                                     "With --history: only its cells."),
          model: Optional[str] = typer.Option(None, "--model",
                                              help="Model the requests name (default: the config's first). "
                                                   "With --history: only its cells."),
          concurrency: Optional[str] = typer.Option(None, "--concurrency",
                                                    help="Closed-loop loads, clients always waiting, e.g. "
                                                         "50,100 (default 50,100,200,500; --quick 10,25,50,100,200)."),
          rates: Optional[str] = typer.Option(None, "--rates",
                                              help="Open-loop loads instead, Poisson requests per second, "
                                                   "e.g. 100,400."),
          max_batch: Optional[str] = typer.Option(None, "--max-batch",
                                                  help="max_batch values (default 4,8,16,32; --quick 8,32)."),
          window_ms: Optional[str] = typer.Option(None, "--window-ms",
                                                  help="window_ms values (default 10,50,100,200; --quick 10,100)."),
          mix: str = typer.Option("7:2:1", "--mix", help="Request mix short:medium:long (the guide's classes: "
                                                         "16-512, 513-2048, 2049-12000 tokens)."),
          trace: Optional[Path] = typer.Option(None, "--trace",
                                               help="Take request sizes from a real trace (any --trace format of simulate) instead of --mix."),
          duration_s: Optional[float] = typer.Option(None, "--duration-s", min=0.1,
                                                     help="Measured seconds per cell (default 10; --quick 1)."),
          warmup_s: Optional[float] = typer.Option(None, "--warmup-s", min=0.0,
                                                   help="Warm-up seconds per cell, not measured "
                                                        "(default 2; --quick 0.25)."),
          simulated: bool = typer.Option(False, "--simulated",
                                         help="Run the matrix on the engine with the simulated device "
                                              "(no daemon; seconds; figures SIMULATED)."),
          quick: bool = typer.Option(False, "--quick", help="A small matrix for a smoke run (20 cells: loads 10,25,50,100,200 × max_batch 8,32 × window 10,100)."),
          history: bool = typer.Option(False, "--history", help="Show recorded cells (newest first) and exit."),
          db: Optional[Path] = typer.Option(None, "--db", help="Configuration database (default: "
                                                               "STATE_DIR/tuning.sqlite of the config)."),
          out_dir: Optional[Path] = typer.Option(None, "--out", help="Folder for the pictures (default: "
                                                                     "STATE_DIR/bench/<UTC time>/)."),
          seed: int = typer.Option(1, "--seed", help="Random seed of the request sizes and arrivals."),
          wide: bool = typer.Option(False, "--wide", help=WIDE_HELP),
          as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts instead of tables.")) -> None:
    """Run the guide's test matrix (load × mix × max_batch × window) and record every cell.

    Live, each cell retunes the channel through the control socket; its settings are restored at
    the end, on an error and on Ctrl-C. --simulated runs on the engine instead (SIMULATED). Rows go
    to STATE_DIR/tuning.sqlite; pictures and the knee of each QPS-vs-load curve to --out.

    Example: dynbatchctl bench --simulated --quick;  dynbatchctl bench --channel standard
    --concurrency 50,100 --max-batch 8,16 --window-ms 10,50;  dynbatchctl bench --history --json
    """
    cfg, cfg_path = _load_config(ctx)
    db_path = db or database_path(cfg.daemon)
    if history:
        try:
            return _history(db_path, channel, model, as_json, wide)
        except (OSError, cells.sqlite3.Error) as exc:
            raise fail(f"the configuration database {db_path}: {exc}", 1) from None
    shape = B.QUICK if quick else B.FULL
    channel = channel or cfg.routing.default
    if channel not in cfg.channels:
        raise fail(f"--channel {channel!r}: no such channel in {cfg_path} (have {', '.join(cfg.channels)})", 2)
    model = model or next(iter(cfg.models), "sim")
    rate_list = _numbers(rates, float, "--rates")
    loads = _numbers(concurrency, int, "--concurrency") or ([] if rate_list else list(shape["loads"]))
    if rates and concurrency:
        raise fail("give --concurrency (closed loop) or --rates (open loop), not both", 2)
    try:
        matrix = B.matrix(channel, model, max_batch=_numbers(max_batch, int, "--max-batch") or shape["max_batch"],
                          window_ms=_numbers(window_ms, float, "--window-ms") or shape["window_ms"],
                          concurrency=loads, rates=rate_list, mix=mix, trace=str(trace) if trace else None)
        B.token_sampler(mix, str(trace) if trace else None, seed, limits.MOST_REQUESTS)   # a bad mix or trace: one line, now
        for cell in matrix:
            cfgmod.check_channel_values(channel, {"max_batch": cell.max_batch, "window_ms": cell.window_ms})
    except cfgmod.ConfigError as exc:
        raise fail(f"refused: {exc.key}: {exc.rule}", 2) from None
    except (ValueError, OSError, KeyError) as exc:
        raise fail(str(exc), 2) from None
    duration = duration_s if duration_s is not None else (1.0 if quick else 10.0)
    warmup = warmup_s if warmup_s is not None else (0.25 if quick else 2.0)
    if simulated:
        limits.check_volume(max(rate_list, default=0.0), duration + warmup, "--rates × (--duration-s + --warmup-s)")
    if out_dir is not None:
        check_writable(out_dir, "--out", folder=True)
    run_id, commit = cells.new_run_id(), cells.commit_id()
    cfg_hash = cells.config_hash(cfgmod.to_dict(cfg))
    live = None
    if not simulated:
        call = ctx.obj.call   # the control call dynbatchctl gave its Target (one a test may replace)
        try:
            live = B.LiveBench(call, ctx.obj.endpoint, channel, **ctx.obj.curve_args(ctx.obj.endpoint))
            cfg_hash = cells.config_hash(call("config"))
        except (DynbatchdError, ValueError) as exc:
            raise fail(str(exc), 1) from None
    try:
        Path(db_path).parent.mkdir(parents=True, exist_ok=True)
        db_conn = connect(db_path)
        cells.ensure_schema(db_conn)
    except (OSError, cells.sqlite3.Error) as exc:
        raise fail(f"the configuration database {db_path}: {exc}", 1) from None
    plugins = None
    if simulated:
        from dynbatchd.plugins import Plugins
        plugins = Plugins.load()
    rows: list[dict[str, Any]] = []
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: Any) -> None:
        raise _Stop()
    interrupted = None
    label = "[yellow]SIMULATED[/yellow] " if simulated else ""
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                        TextColumn("{task.fields[best]}"), console=err, transient=as_json, disable=as_json)
    try:
        if live is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_term)   # (a handler can only be set from the main thread)
        with progress:
            task = progress.add_task(f"{label}bench {escape(channel)}", total=len(matrix), best="")
            for cell in matrix:
                progress.update(task, description=f"{label}{escape(cell.label())}")
                if live is not None:
                    figures = live.run(cell, duration_s=duration, warmup_s=warmup, seed=seed)
                else:
                    figures = B.simulated_cell(cfg, cell, duration_s=duration, warmup_s=warmup, seed=seed,
                                               plugins=plugins)
                row = {"run_id": run_id, "at": time.time(), "simulated": simulated, "channel": cell.channel,
                       "model": cell.model, "max_batch": cell.max_batch, "window_ms": cell.window_ms,
                       "policy": _policy(cfg, channel), "load_kind": cell.load_kind, "load": cell.load,
                       "mix": cell.mix, "trace": cell.trace, "commit_id": commit, "config_hash": cfg_hash,
                       **figures.as_dict()}
                row["id"] = cells.insert(db_conn, row)
                row["extra"] = figures.extra
                rows.append(row)
                top = B.best(rows)
                progress.update(task, advance=1, best=f"best: max_batch={top['max_batch']} "
                                                       f"window={top['window_ms']:g}ms {top['qps']:.0f} QPS")
    except (KeyboardInterrupt, _Stop) as exc:
        interrupted = "interrupted (Ctrl-C)" if isinstance(exc, KeyboardInterrupt) else "stopped (SIGTERM)"
    except (DynbatchdError, OSError) as exc:
        interrupted = f"failed: {exc}"
    finally:
        if live is not None:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, previous)
            try:
                live.restore()
            except DynbatchdError as exc:
                err.print(f"[red]error:[/red] could not restore channel {escape(channel)} to "
                          f"{live.original}: {escape(str(exc))}", highlight=False)
        db_conn.close()
    try:
        where = out_dir or Path(cfgmod.state_path(cfg.daemon, "bench")) / run_id
        pictures = plots.write_all(rows, where, commit) if rows else {}
    except OSError as exc:   # the cells are in the database already: say so, and where the pictures failed
        raise fail(f"cannot write the pictures: {exc.strerror or exc} ({len(rows)} cells recorded in {db_path})",
                   1) from None
    knees = {f"max_batch={b} window_ms={w:g}": (c["knee"].as_dict() if c["knee"] else None)
             for (b, w), c in plots.curves(rows).items()}
    data = {"simulated": simulated, "run_id": run_id, "commit": commit, "config_hash": cfg_hash,
            "database": str(db_path), "channel": channel, "model": model, "cells": rows,
            "best": B.best(rows), "knees": knees, "pictures": pictures,
            "restored": live.original if live is not None and live.restored else None,
            "complete": interrupted is None and len(rows) == len(matrix)}
    if interrupted:
        data["stopped"] = interrupted
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    else:
        _table(list(reversed(rows)), ("SIMULATED " if simulated else "") + f"bench {channel} / {model}, run {run_id}, "
               f"commit {commit}", wide=wide)
        top = data["best"]
        if top:
            out.print(f"best: max_batch={top['max_batch']} window_ms={top['window_ms']:g} at load {top['load']:g}: "
                      f"{top['qps']:.1f} QPS, {100 * (top['on_time'] or 0):.1f}% on time"
                      + (" (SIMULATED)" if simulated else ""), highlight=False)
        curves = {f"max_batch={b} window_ms={w:g}": c for (b, w), c in plots.curves(rows).items()}
        for name, knee in knees.items():
            out.print(f"knee {name}: " + (f"load {knee['load']:g}, {knee['qps']:.1f} QPS" if knee
                                          else "none found" + _why_no_knee(curves[name])), highlight=False)
        for kind, path in pictures.items():
            out.print(f"{kind}:", highlight=False)   # the path alone on its line, whole: it is copied, not read
            out.print(escape(path), highlight=False, soft_wrap=True)
        if live is not None and live.restored:
            out.print(f"channel {escape(channel)} restored: " + ", ".join(f"{k}={v}" for k, v in live.original.items()),
                      highlight=False)
    if interrupted:
        err.print(f"[yellow]bench {escape(interrupted)}[/yellow]; {len(rows)} of {len(matrix)} cells recorded",
                  highlight=False)
        raise typer.Exit(130 if "Ctrl-C" in interrupted else 1)


def _policy(cfg: cfgmod.Config, channel: str) -> str:
    window = cfg.channels[channel].window
    return window.policy if window is not None else "fixed"


def _why_no_knee(curve: dict[str, Any]) -> str:
    """A hint for a curve without a knee: already flat from the smallest load, or still rising."""
    qps, loads = curve["qps"], curve["loads"]
    if len(loads) < 3:
        return " (fewer than 3 loads)"
    if max(qps) <= qps[0] * 1.05:
        return f" (flat: saturated at or below {loads[0]:g})"
    return " (no lasting slope drop: not saturated in this range)"
