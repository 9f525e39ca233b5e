"""`dynbatchctl recommend`: the guide's recommender, on the daemon's own traffic.

Reads what the running daemon has observed (each channel's offered rate, mean
request size, and the batch cost its cost model learned), replays traffic of
that shape through the scheduler on simulated devices for every setting of the
guide's grid (max_batch 4/8/16/32 x window 10/50/100/200 ms), one channel at
a time (worst first, each with the earlier ones already retuned), and recommends the setting that keeps clearly more of that channel's
requests on time (then of all requests, then a p99 at least 10% lower); the
current setting stays when nothing beats it by that much. Candidates are
checked by the same rules as a config file, compliance included. `--apply`
applies them with `tune`. Every figure is SIMULATED. It refuses until a channel has timed
20 batches (the collector's rule). `tune --auto` is the full loop (risk, canary, history).
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

import msgspec
import typer
from rich.console import Console
from rich.markup import escape

from dynbatchd import config as cfgmod, errors
from dynbatchd.client import control_call
from dynbatchd.config import ConfigError
from dynbatchd.plugins import Plugins
from dynbatchd.simulate import Arrival, DeviceModel, poisson, run_config
from dynbatchd.tuning.collector import MIN_BATCHES
from dynbatchd.cli.tables import WIDE_HELP, fit_table, show
from dynbatchd.validation import validate_config

SECOND = 1_000_000_000
GRID = [(b, w) for b in (4, 8, 16, 32) for w in (10.0, 50.0, 100.0, 200.0)]
MAX_ARRIVALS = 20_000   # per simulated run, so a busy daemon's plan still takes seconds


def observed_traffic(channels: dict[str, Any], duration_s: float, seed: int) -> list[Arrival]:
    """Poisson arrivals per channel at its observed rate and mean size, sent straight to it."""
    rng = random.Random(seed)
    out = []
    for name, c in channels.items():
        rate, tokens = c.get("arrival_rps", 0.0), round(c.get("mean_tokens", 0.0))
        out += [Arrival(int(t * SECOND), tokens, name) for t in poisson(rng, rate, 0.0, duration_s)]
    out.sort(key=lambda a: a.at_ns)
    return out


def observed_device(channels: dict[str, Any]) -> DeviceModel | None:
    """The batch cost learned by the channel that ran the most batches."""
    learned = [c for c in channels.values() if c.get("cost_ms", {}).get("samples", 0) >= MIN_BATCHES]
    if not learned:
        return None
    cost = max(learned, key=lambda c: c["cost_ms"]["samples"])["cost_ms"]
    return DeviceModel(cost["base"], cost["per_item"], cost["per_token"])


def score(result: Any, channel: str) -> tuple[float, float, float]:
    """(the channel's on-time share, everyone's on-time share, the channel's p99 in ms)."""
    mine = result.stats("channel").get(channel)
    total = result.total()
    return (mine.on_time_fraction if mine else 1.0, total.on_time_fraction, mine.p99_ms if mine else 0.0)


TOLERANCE = 0.0005   # on-time shares closer than this are equal: a change must be worth making


def better(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
    """Is `a` clearly better than `b`: more of the channel on time, else more of everyone,
    else a p99 at least 10% lower."""
    if abs(a[0] - b[0]) > TOLERANCE:
        return a[0] > b[0]
    if abs(a[1] - b[1]) > TOLERANCE:
        return a[1] > b[1]
    return a[2] < 0.9 * b[2]


def plan_channels(cfg: cfgmod.Config, status: dict[str, Any], duration_s: float, seed: int,
                  plugins: Plugins) -> dict[str, Any]:
    channels = status["channels"]
    device = observed_device(channels)
    if device is None:
        most = max((c.get("cost_ms", {}).get("samples", 0) for c in channels.values()), default=0)
        raise ValueError(f"the daemon has not run enough batches to know their cost yet: a channel needs "
                         f"{MIN_BATCHES} timed batches (the most any has is {most}); try again under traffic")
    rate = sum(c.get("arrival_rps", 0.0) for c in channels.values())
    if rate <= 0:
        raise ValueError("no traffic observed in the last seconds; try again under traffic")
    duration_s = min(duration_s, MAX_ARRIVALS / rate)
    arrivals = observed_traffic(channels, duration_s, seed)
    devices = max(1, len(status["devices"]))
    def run(config: cfgmod.Config) -> Any:
        return run_config(config, plugins, arrivals, [device] * devices)

    baseline = run(cfg)
    plan: dict[str, Any] = {"simulated": True, "device_model": device.options(), "devices": devices,
                            "seconds": round(duration_s, 2), "requests": len(arrivals), "channels": {}}
    busy = [n for n in cfg.channels if channels.get(n, {}).get("arrival_rps", 0.0) > 0]
    # Coordinate descent, worst channel first: each channel is tuned with the ones before it
    # already at their recommended settings, so a later channel is not bent around an earlier one.
    busy.sort(key=lambda n: score(baseline, n)[0])
    for name in busy:
        settings = cfg.channels[name]
        now = (settings.max_batch, settings.window_ms)
        best, best_score = now, score(run(cfg), name)
        current = score(baseline, name)
        for b, w in GRID:
            if (b, w) == now:
                continue
            try:
                candidate = cfgmod.with_channel(cfg, name, max_batch=b, window_ms=w)
                validate_config(candidate, plugins)
            except ConfigError:
                continue   # e.g. a window past the deadline, or the banking limit
            s = score(run(candidate), name)
            if better(s, best_score):
                best, best_score = (b, w), s
        if best != now:
            cfg = cfgmod.with_channel(cfg, name, max_batch=best[0], window_ms=best[1])
        plan["channels"][name] = {
            "current": {"max_batch": now[0], "window_ms": now[1], "on_time": current[0], "p99_ms": current[2]},
            "recommended": {"max_batch": best[0], "window_ms": best[1], "on_time": best_score[0],
                            "p99_ms": best_score[2]},
            "change": best != now,
        }
    return plan


def recommend(ctx: typer.Context,
              duration: float = typer.Option(20.0, "--duration", min=1.0, help="Seconds of traffic to simulate."),
              seed: int = typer.Option(1, "--seed", help="Random seed (the run is deterministic)."),
              apply: bool = typer.Option(False, "--apply", help="Apply the recommendations with tune."),
              wide: bool = typer.Option(False, "--wide", help=WIDE_HELP),
              as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts instead of tables.")) -> None:
    """Recommend max_batch and window per channel from the daemon's observed traffic (SIMULATED)."""
    err = Console(stderr=True)
    try:
        status = control_call(ctx.obj.control, "status", **ctx.obj.curve_args(ctx.obj.control))
        raw = control_call(ctx.obj.control, "config", **ctx.obj.curve_args(ctx.obj.control))
        raw.pop("source", None)
        cfg = cfgmod.parse(raw, "running config")
        plan = plan_channels(cfg, status, duration, seed, Plugins.load())
    except (errors.DynbatchdError, ValueError, msgspec.ValidationError) as exc:   # the client's, a config's: one base
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(1)
    applied = []
    if apply:
        for name, p in plan["channels"].items():
            if p["change"]:
                control_call(ctx.obj.control, "tune", **ctx.obj.curve_args(ctx.obj.control), channel=name, max_batch=p["recommended"]["max_batch"],
                             window_ms=p["recommended"]["window_ms"])
                applied.append(name)
    plan["applied"] = applied
    if as_json:
        sys.stdout.write(json.dumps(plan, indent=2) + "\n")
        return
    out = Console()
    out.print(f"[yellow]SIMULATED[/yellow] {plan['requests']} requests over {plan['seconds']:g} s shaped like the "
              f"observed traffic, on {plan['devices']} device(s) costing {plan['device_model']['base_ms']:.2f} ms + "
              f"{plan['device_model']['per_item_ms']:.3f} ms/request + {plan['device_model']['per_token_ms']:.5f} "
              "ms/token per batch (learned by the daemon)", highlight=False)
    columns = [("channel", 0), ("now", 0), ("on time", 1), ("p99 ms", 3), ("recommended", 0), ("then on time", 0),
               ("then p99 ms", 2), ("", 0)]
    rows = []
    for name, p in plan["channels"].items():
        c, r = p["current"], p["recommended"]
        rows.append([name, f"{c['max_batch']}/{c['window_ms']:g}ms", f"{100 * c['on_time']:.2f}%", f"{c['p99_ms']:.1f}",
                     f"{r['max_batch']}/{r['window_ms']:g}ms", f"{100 * r['on_time']:.2f}%", f"{r['p99_ms']:.1f}",
                     "applied" if name in applied else ("keep" if not p["change"] else "")])
    show(out, fit_table("recommendations (SIMULATED): max_batch/window", columns, rows, out, wide,
                        left={"channel", "now", "recommended", ""}), wide)
    for name, p in plan["channels"].items():
        if p["change"] and name not in applied:
            r = p["recommended"]
            out.print(f"dynbatchctl tune {name} --max-batch {r['max_batch']} --window-ms {r['window_ms']:g}",
                      highlight=False)
