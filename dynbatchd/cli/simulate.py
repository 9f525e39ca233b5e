"""`dynbatchctl simulate`: capacity planning with the daemon's own scheduler on simulated devices.

Offline, no daemon needed. Channels, routing and policies come from a config
file; the devices follow the simulated runner's latency model; the traffic is
Poisson at a given rate (or a CSV trace). Every figure is SIMULATED.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from dynbatchd import config as cfgmod
from dynbatchd.errors import DynbatchdError
from dynbatchd.plugins import Plugins
from dynbatchd.simulate import (Arrival, DeviceModel, config_device, mix_tokens, poisson, read_trace_csv, run_config,
                                simulated_model_options)
from dynbatchd.cli import limits
from dynbatchd.cli.simulate_generative import generative_data, modes_of, show_generative
from dynbatchd.cli.tables import WIDE_HELP, fit_table, show
from dynbatchd.simulate.generative import SCENARIOS, generative_model
from dynbatchd.validation import validate_config

SECOND = 1_000_000_000


def poisson_arrivals(rate_rps: float, duration_s: float, seed: int, urgent_share: float,
                     tokens: int | None) -> list[Arrival]:
    rng = random.Random(seed)
    out = []
    for t in poisson(rng, rate_rps, 0.0, duration_s):
        n = mix_tokens(rng)[1] if tokens is None else tokens
        tags = ("urgent",) if rng.random() < urgent_share else ()
        out.append(Arrival(int(t * SECOND), n, tags=tags))
    return out


def trace_arrivals(path: Path, compress: float, seed: int = 1, urgent_share: float = 0.0) -> list[Arrival]:
    """A real trace (`read_trace_csv`: Azure LLM, BurstGPT or Mooncake format), sped up ×compress;
    a seeded `urgent_share` of the requests is tagged ``urgent``, as in the Poisson traffic."""
    rng = random.Random(seed)
    rows = read_trace_csv(path, most=limits.MOST_REQUESTS)   # every row is simulated: the run's bound
    if not rows:   # a header alone: a report of nothing would pass for a result
        raise ValueError(f"--trace {path}: no requests in it")
    span = rows[-1][0] / compress
    if span > limits.MOST_TRACE_SPAN_S:
        raise ValueError(f"--trace {path}: spans {span:,.0f} simulated s at --compress {compress:g}; at most "
                         f"{limits.MOST_TRACE_SPAN_S:,.0f} (raise --compress or replay a part of it)")
    return [Arrival(int(at / compress * SECOND), tokens, tags=("urgent",) if rng.random() < urgent_share else ())
            for at, tokens in rows]


def device_models(cfg: cfgmod.Config, base_ms: float | None, per_item_ms: float | None,
                  per_token_ms: float | None, count: int | None) -> tuple[list[str], list[DeviceModel]]:
    """(device names, their latency models): the config's first simulated model's options on each
    device, its ``devices`` entry for that device over them (a mixed pool), the options given on
    the command line over both. The devices are `[devices] use` when it names them (a list), else
    those the ``devices`` table names, else one; `count` (--devices) takes the first N of those
    and adds devices with the shared options past them."""
    options = simulated_model_options(cfg)
    overrides = {key: value for key, value in (("base_ms", base_ms), ("per_item_ms", per_item_ms),
                                               ("per_token_ms", per_token_ms)) if value is not None}
    use = cfg.devices.use
    names = list(use) if isinstance(use, list) else sorted(options.get("devices", {})) or ["cpu"]
    if count is not None:
        names = (names + [f"sim:{i}" for i in range(len(names), count)])[:count]
    models = [config_device(cfg, device=name, **overrides) for name in names]
    return names, models


def simulate(ctx: typer.Context,
             config: Optional[Path] = typer.Option(None, "--config", "-c",
                                                   help="Config whose channels and routing to simulate "
                                                        "(default: dynbatchctl --config, else $DYNBATCHD_CONFIG, "
                                                        "./etc/dynbatchd.toml, /etc/dynbatchd/dynbatchd.toml)."),
             rate: Optional[float] = typer.Option(None, "--rate", min=0.001,
                                                  help="Offered requests per second (Poisson; default 500, "
                                                       "on a generative config 5)."),
             duration: float = typer.Option(30.0, "--duration", min=0.1, help="Seconds of simulated traffic."),
             devices: Optional[int] = typer.Option(None, "--devices", min=1,
                                                   help="Simulated devices (default: those \\[devices] use names, "
                                                        "else those the simulated model's devices table names, "
                                                        "else 1)."),
             base_ms: Optional[float] = typer.Option(None, "--base-ms", min=0.0,
                                                     help="Per-batch time (default: the config's simulated "
                                                          "model, else 8)."),
             per_item_ms: Optional[float] = typer.Option(None, "--per-item-ms", min=0.0,
                                                         help="Per-request time (default: as above, else 0.5)."),
             per_token_ms: Optional[float] = typer.Option(None, "--per-token-ms", min=0.0,
                                                          help="Per-token time (default: as above, else 0)."),
             tokens: Optional[int] = typer.Option(None, "--tokens", min=0,
                                                  help="Tokens per request (default: the guide's 7:2:1 mix)."),
             urgent_share: float = typer.Option(0.1, "--urgent-share", min=0.0, max=1.0,
                                                help="Fraction of requests tagged urgent (Poisson or --trace)."),
             trace: Optional[Path] = typer.Option(None, "--trace",
                                                  help="Replay a real trace instead of Poisson: Azure LLM CSV "
                                                       "(TIMESTAMP, ContextTokens), BurstGPT CSV or Mooncake JSON lines."),
             compress: float = typer.Option(1.0, "--compress", min=0.001, help="Speed-up of the --trace times."),
             seed: int = typer.Option(1, "--seed", help="Random seed (the run is deterministic)."),
             scenario: Optional[str] = typer.Option(None, "--scenario",
                                                    help="Generative workload: mixed (default on a config with a "
                                                         "causal-lm model) or k12 (95%% short chats, 5%% 10k+ "
                                                         "token grading)."),
             mode: str = typer.Option("both", "--mode",
                                      help="Generative batching to simulate: continuous, static or both."),
             wide: bool = typer.Option(False, "--wide", help=WIDE_HELP),
             as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts instead of tables.")) -> None:
    """Simulate the config's channels on simulated devices: goodput, p99 and utilisation (SIMULATED)."""
    err = Console(stderr=True, soft_wrap=True)   # an error is one line, never wrapped
    path = cfgmod.find_config(config or getattr(ctx.obj, "config", None))   # or the global dynbatchctl --config
    try:
        if path is None:
            raise ValueError(f"no config file found (searched {cfgmod.search_order_text()})")
        modes = modes_of(mode)   # a misspelt --mode is refused on any config, not ignored
        cfg = cfgmod.load(path)
        plugins = Plugins.load()
        validate_config(cfg, plugins)   # what the daemon would refuse is not simulated either
        if scenario is not None or (generative_model(cfg) and not any(m.runner == "simulated"
                                                                       for m in cfg.models.values())):
            if scenario not in (None, *SCENARIOS):
                raise ValueError(f"--scenario must be one of {', '.join(SCENARIOS)}, got {scenario!r}")
            if trace is not None or tokens is not None:   # the scenario draws prompt and output lengths
                raise ValueError("--trace and --tokens are not modelled for a generative config (see --scenario)")
            limits.check_volume(5.0 if rate is None else rate, duration, "--rate × --duration")
            latency = {"step_ms": base_ms, "per_seq_ms": per_item_ms, "prefill_ms_per_token": per_token_ms}
            used = len(cfg.devices.use) if isinstance(cfg.devices.use, list) else 1
            data = generative_data(cfg, path, scenario=scenario or "mixed", modes=modes,
                                   rate=5.0 if rate is None else rate, duration=duration, devices=devices or used,
                                   seed=seed, latency={k: v for k, v in latency.items() if v is not None})
            return show_generative(data, as_json, wide)
        rate = 500.0 if rate is None else rate
        if trace is None:
            limits.check_volume(rate, duration, "--rate × --duration")
        arrivals = trace_arrivals(trace, compress, seed, urgent_share) if trace else \
            poisson_arrivals(rate, duration, seed, urgent_share, tokens)
    except (DynbatchdError, OSError, KeyError, ValueError) as exc:   # ours, the disk's, a trace's
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(2)
    names, models = device_models(cfg, base_ms, per_item_ms, per_token_ms, devices)
    model = models[0]
    result = run_config(cfg, plugins, arrivals, models)
    per = result.stats("channel")
    data = {
        "simulated": True, "config": str(path), "devices": len(models), "device_model": model.options(),
        "device_models": {name: m.options() for name, m in zip(names, models)},
        "requests": len(arrivals), "utilisation": round(result.utilisation(), 4),
        "channels": {name: {"offered": g.offered, "completed": g.completed, "on_time": g.on_time_fraction,
                            "p50_ms": g.p50_ms, "p99_ms": g.p99_ms, "expired": g.expired,
                            "overloaded": g.overloaded, "mean_batch": result.mean_batch(name)}
                     for name, g in per.items()},
    }
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return
    out = Console()
    source = f"trace {trace} ×{compress:g}" if trace else f"Poisson {rate:g} req/s for {duration:g} s"
    kinds = {(m.base_ms, m.per_item_ms, m.per_token_ms) for m in models}
    each = (f"{model.base_ms:g} ms + {model.per_item_ms:g} ms/request + {model.per_token_ms:g} ms/token"
            if len(kinds) == 1 else "; ".join(f"{n}: {m.base_ms:g} + {m.per_item_ms:g}/request + "
                                              f"{m.per_token_ms:g}/token ms" for n, m in zip(names, models)))
    out.print(f"[yellow]SIMULATED[/yellow] {len(arrivals)} requests ({source}) on {len(models)} simulated "
              f"device(s): {each}; channels from {path}", highlight=False)
    columns = [("channel", 0), ("offered", 3), ("on time", 0), ("p50 ms", 4), ("p99 ms", 0), ("expired", 1),
               ("overloaded", 1), ("mean batch", 2)]
    rows = [[name, str(c["offered"]), f"{100 * c['on_time']:.2f}%", f"{c['p50_ms']:.1f}", f"{c['p99_ms']:.1f}",
             str(c["expired"]), str(c["overloaded"]), f"{c['mean_batch']:.1f}"] for name, c in data["channels"].items()]
    show(out, fit_table("channels (SIMULATED)", columns, rows, out, wide, left={"channel"}), wide)
    out.print(f"device utilisation {100 * data['utilisation']:.1f}% (SIMULATED)")
