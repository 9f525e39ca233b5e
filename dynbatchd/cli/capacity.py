"""`dynbatchctl capacity`: devices, monthly cost and energy for a daily volume, with batching and without.

Offline, no daemon needed. Channels and routing come from the config (as
`simulate` finds it); the device from a profile (`dynbatchd.capacity`). Every
figure is SIMULATED from the profile's cost curve, whose figures are the
profile's (shipped ones are ESTIMATES, each file says how derived). Several
profiles make a mixed pool, searched in units of one device of each.
"""

from __future__ import annotations

import html
import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape

from dynbatchd import capacity as cap
from dynbatchd import config as cfgmod
from dynbatchd.errors import DynbatchdError
from dynbatchd.plugins import Plugins
from dynbatchd.cli import limits
from dynbatchd.cli.output import check_writable
from dynbatchd.cli.capacity_generative import generative_capacity, render_generative
from dynbatchd.cli.tables import WIDE_HELP, fit_table, show
from dynbatchd.simulate.generative import SCENARIOS, is_generative
from dynbatchd.validation import validate_config


def _money(x: float) -> str:
    return f"${x:,.0f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def requests_of(text: str) -> float:
    """--requests-per-day as a number, within `limits` (one line naming the option otherwise)."""
    try:
        count = cap.parse_count(text)
    except ValueError as exc:
        raise ValueError(f"--requests-per-day {exc}") from None
    return limits.check("--requests-per-day", count)


def build(config: Path | None, requests_per_day: str, peak_factor: float, duration: float, urgent_share: float,
          tokens: int | None, trace: Path | None, profile: str, compare: str | None, target: float,
          priority_target: float, seed: int, scenario: str | None = None, out_given: bool = False) -> dict[str, Any]:
    """Everything `capacity` prints, as data."""
    path = cfgmod.find_config(config)
    if path is None:
        raise ValueError(f"no config file found (searched {cfgmod.search_order_text()})")
    cfg = cfgmod.load(path)
    plugins = Plugins.load()
    validate_config(cfg, plugins)
    traffic = cap.Traffic(requests_of(requests_per_day), peak_factor, duration, urgent_share, tokens, trace, seed,
                          limits.MOST_REQUESTS)
    limits.check_volume(traffic.peak_rps, duration, "--requests-per-day × --peak-factor × --duration")
    if is_generative(cfg):   # a causal-lm model: devices to meet the TTFT/TPOT targets
        if compare or trace or out_given:
            raise ValueError("--compare-profile, --trace and --out are not modelled for a generative config")
        return generative_capacity(cfg, path, traffic, profile, target, scenario or "mixed")
    targets = cap.targets_for(cfg.channels, target, priority_target)
    sim = dict(inflight=cfg.devices.inflight, queue_lead_ms=cfg.devices.queue_lead_ms,
               routing=cfgmod.table_of(cfg, "routing"),
               plugins=plugins, window_policies=plugins.window_policies(), sizers=plugins.batch_sizers(),
               size_for_device=True)   # batches cut to the profile's memory limits, as a sized pool is
    plans = []
    for spec in [profile] + ([compare] if compare else []):
        kinds = cap.load_pool(spec)   # several, comma-separated: a mixed pool, one device of each per unit
        plans.append(cap.plan(cfg.channels, traffic, kinds if len(kinds) > 1 else kinds[0], targets, **sim).as_dict())
    data: dict[str, Any] = {
        "simulated": True, "config": str(path),
        "traffic": {"requests_per_day": traffic.requests_per_day, "peak_factor": peak_factor,
                    "peak_rps": traffic.peak_rps, "simulated_seconds": duration, "urgent_share": urgent_share,
                    "tokens": tokens if tokens is not None else "guide 7:2:1 mix",
                    "trace": str(trace) if trace else None, "seed": seed},
        "hours_per_month": cap.HOURS_PER_MONTH, "plans": plans, "nvml": cap.nvml_power()}
    if len(plans) == 2:
        a, b = plans[0]["batched"], plans[1]["batched"]
        data["comparison"] = {"profiles": [plans[0]["profile"]["name"], plans[1]["profile"]["name"]],
                              "devices_ratio": b["devices"] / a["devices"],
                              "monthly_cost_ratio": b["monthly_cost"] / a["monthly_cost"] if a["monthly_cost"] else None,
                              "energy_ratio": b["energy_j_per_request"] / a["energy_j_per_request"]}
    return data


def render(data: dict[str, Any], out: Console, wide: bool = False) -> None:
    """The report for a person: the tables fit the console (the monthly cost always shown); `wide`: all columns."""
    t = data["traffic"]
    out.print(f"[yellow]SIMULATED[/yellow] {t['requests_per_day']:,.0f} requests/day, peak ×{t['peak_factor']:g} = "
              f"{t['peak_rps']:.1f} req/s, {t['simulated_seconds']:g} s of peak traffic per trial "
              f"({t['trace'] or 'Poisson'}, tokens: {t['tokens']}); channels from {data['config']}", highlight=False)
    for p in data["plans"]:
        prof = p["profile"]
        if "devices" in prof:
            out.print(f"\n[bold]{prof['name']}[/bold]: {prof['description']}, ${prof['price_per_hour']:.2f}/h a unit",
                      highlight=False)
        for kind in prof.get("devices", [prof]):
            c = kind["cost"]
            out.print(("  " if "devices" in prof else "\n") + f"[bold]{kind['name']}[/bold]: {kind['description']} — "
                      f"{c['base_ms']:g} ms + {c['per_item_ms']:g} ms/request + {c['per_token_ms']:g} ms/token, "
                      f"{kind['memory_gb']:g} GB, {kind['power_idle_w']:g}-{kind['power_busy_w']:g} W, "
                      f"${kind['price_per_hour']:.2f}/h" + (" [yellow](ESTIMATES)[/yellow]" if kind["estimate"] else ""),
                      highlight=False)
        out.print(f"[dim]source: {escape(prof['source'])}[/dim]", highlight=False)
        pool = [("", 0), ("devices", 0), ("monthly cost", 0), ("J/request", 1), ("device ms/request", 3),
                ("utilisation", 2), ("price", 4), ("searched", 5)]
        pool_rows = []
        for label, key in (("with batching", "batched"), ("without (max_batch 1)", "unbatched")):
            s = p[key]
            pool_rows.append([label, str(s["devices"]), _money(s["monthly_cost"]), f"{s['energy_j_per_request']:.3f}",
                              f"{s['busy_ms_per_request']:.3f}", f"{100 * s['utilisation']:.1f}%",
                              f"{s['units']}×${prof['price_per_hour']:.2f}×{data['hours_per_month']:g}h",
                              " ".join(f"{tr['devices']}{'✓' if tr['holds'] else '✗'}" for tr in s["trials"])])
        show(out, fit_table(f"{prof['name']}: pool at the peak hour (SIMULATED)", pool, pool_rows, out, wide,
                            left={""}), wide)
        per = [("channel", 0), ("target", 2), ("batched", 0), ("p99 ms", 1), ("mean batch", 3), ("unbatched", 1),
               ("unbatched p99", 4)]
        per_rows = []
        for name, target in p["targets"].items():
            b, u = p["batched"]["channels"].get(name), p["unbatched"]["channels"].get(name)
            if b is None and u is None:
                continue
            per_rows.append([name, _pct(target), _pct(b and b["on_time"]), f"{b['p99_ms']:.1f}" if b else "-",
                             f"{b['mean_batch']:.1f}" if b else "-", _pct(u and u["on_time"]),
                             f"{u['p99_ms']:.1f}" if u else "-"])
        show(out, fit_table(f"{prof['name']}: on time per channel (SIMULATED)", per, per_rows, out, wide,
                            left={"channel"}), wide)
        s = p["savings"]
        out.print(f"this traffic: batching saves {_pct(s['devices'])} of the devices, {_pct(s['energy_per_request'])} "
                  f"of the energy per request, {_money(s['monthly_cost'])} a month", highlight=False)
        claim_rows = [[cl["claim"] + (f" ({cl['channel']})" if cl.get("channel") else ""), _pct(cl["this_traffic"]),
                       "[green]yes[/green]" if cl["holds"] else "[red]no[/red]"] for cl in p["claims"]]
        show(out, fit_table("the guide's claims, checked on this traffic (SIMULATED)",
                            [("claim", 0), ("this traffic", 0), ("holds", 0)], claim_rows, out, wide,
                            left={"claim"}), wide)
    if "comparison" in data:
        c = data["comparison"]
        out.print(f"\n{c['profiles'][1]} vs {c['profiles'][0]} (batched): ×{c['devices_ratio']:.2f} devices, "
                  + (f"×{c['monthly_cost_ratio']:.2f} monthly cost, " if c["monthly_cost_ratio"] is not None else "")
                  + f"×{c['energy_ratio']:.2f} energy per request (SIMULATED)", highlight=False)
    if data["nvml"]:
        out.print(f"NVML: {data['nvml']['name']} draws {data['nvml']['power_w']:.0f} W now "
                  "(the profiles' power figures are what the report uses)", highlight=False)


def write_html(data: dict[str, Any], path: Path, command: str) -> None:
    """A one-page summary a manager can read: the answer first, the arithmetic after."""
    e = html.escape
    t = data["traffic"]
    rows = []
    for p in data["plans"]:
        prof, b, u, s = p["profile"], p["batched"], p["unbatched"], p["savings"]
        rows.append(f"<h2>{e(prof['name'])}: {b['devices']} devices with batching, {u['devices']} without</h2>"
                    f"<p>{e(prof['description'])}. Figures are {'ESTIMATES' if prof['estimate'] else 'the profile’s'}"
                    f" (source: {e(prof['source'])}).</p><table border=1 cellpadding=4>"
                    "<tr><th></th><th>devices</th><th>monthly cost</th><th>energy per request (J)</th></tr>"
                    f"<tr><td>with batching</td><td>{b['devices']}</td><td>{_money(b['monthly_cost'])}</td>"
                    f"<td>{b['energy_j_per_request']:.3f}</td></tr>"
                    f"<tr><td>without batching</td><td>{u['devices']}</td><td>{_money(u['monthly_cost'])}</td>"
                    f"<td>{u['energy_j_per_request']:.3f}</td></tr></table>"
                    f"<p>Batching saves {_pct(s['devices'])} of the devices, {_pct(s['energy_per_request'])} of the "
                    f"energy per request and {_money(s['monthly_cost'])} a month on this traffic.</p><ul>"
                    + "".join(f"<li>Guide: {e(c['claim'])} — this traffic: {_pct(c['this_traffic'])} "
                              f"({'holds' if c['holds'] else 'does not hold'})</li>" for c in p["claims"]) + "</ul>")
    if "comparison" in data:
        c = data["comparison"]
        rows.append(f"<h2>{e(c['profiles'][1])} vs {e(c['profiles'][0])}</h2><p>×{c['devices_ratio']:.2f} devices, "
                    f"×{(c['monthly_cost_ratio'] or 0):.2f} monthly cost, ×{c['energy_ratio']:.2f} energy per "
                    "request.</p>")
    path.write_text(
        "<!doctype html><meta charset=utf-8><title>dynbatchd capacity (SIMULATED)</title>"
        "<body style='font-family:sans-serif;max-width:60em'>"
        f"<h1>Capacity for {t['requests_per_day']:,.0f} requests a day (SIMULATED)</h1>"
        f"<p>Peak {t['peak_rps']:.1f} requests/s (×{t['peak_factor']:g} the daily mean). Each channel must hold its "
        "on-time target at the peak hour. Every figure comes from a simulated device, not hardware.</p>"
        + "".join(rows) + f"<p><small>Made by: <code>{e(command)}</code></small></p></body>")


def capacity(ctx: typer.Context,
             config: Optional[Path] = typer.Option(None, "--config", "-c",
                                                   help="Config whose channels and routing to size for (default: "
                                                        "dynbatchctl --config, else $DYNBATCHD_CONFIG, "
                                                        "./etc/dynbatchd.toml, /etc/dynbatchd/dynbatchd.toml)."),
             requests_per_day: str = typer.Option("10M", "--requests-per-day",
                                                  help="Daily volume: 10M, 2.5k, 1e6 or a plain number."),
             peak_factor: float = typer.Option(2.0, "--peak-factor", min=1.0,
                                               help="Peak-hour rate over the daily mean (diurnal traffic)."),
             duration: float = typer.Option(20.0, "--duration", min=1.0,
                                            help="Simulated seconds of peak traffic per trial."),
             urgent_share: float = typer.Option(0.1, "--urgent-share", min=0.0, max=1.0,
                                                help="Fraction of requests tagged urgent (the request mix)."),
             tokens: Optional[int] = typer.Option(None, "--tokens", min=0,
                                                  help="Tokens per request (default: the guide's 7:2:1 mix)."),
             trace: Optional[Path] = typer.Option(None, "--trace",
                                                  help="Take arrivals and sizes from a real trace (Azure LLM CSV, "
                                                       "BurstGPT CSV or Mooncake JSON lines), its mean rate "
                                                       "scaled to the peak rate."),
             profile: str = typer.Option("h100-80gb", "--profile",
                                         help=f"Device profile: shipped ({', '.join(cap.shipped_profiles())}) "
                                              "or a TOML file; several, comma-separated, for a mixed pool "
                                              "(h100-80gb,l4-24gb: one device of each per unit)."),
             compare: Optional[str] = typer.Option(None, "--compare-profile",
                                                   help="A second profile to size side by side, e.g. several "
                                                        "small GPUs against one large one."),
             target: float = typer.Option(0.99, "--target", min=0.0, max=1.0,
                                          help="On-time fraction every channel must hold."),
             priority_target: float = typer.Option(0.9995, "--priority-target", min=0.0, max=1.0,
                                                   help="On-time fraction the highest-priority channel must hold."),
             seed: int = typer.Option(1, "--seed", help="Random seed (the run is deterministic)."),
             scenario: Optional[str] = typer.Option(None, "--scenario",
                                                    help="A generative config's workload: mixed (default) or k12."),
             out: Optional[Path] = typer.Option(None, "--out", help="Also write an HTML summary to this file."),
             wide: bool = typer.Option(False, "--wide", help=WIDE_HELP),
             as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts instead of tables.")) -> None:
    """Devices, monthly cost and energy per request for a daily volume, with and without batching (SIMULATED)."""
    if out is not None:
        check_writable(out, "--out")
    try:
        data = build(config or getattr(ctx.obj, "config", None), requests_per_day, peak_factor, duration,
                     urgent_share, tokens, trace, profile, compare, target, priority_target, seed, scenario,
                     out is not None)
        if scenario not in (None, *SCENARIOS) or (scenario and not data.get("generative")):
            raise ValueError(f"--scenario takes {' or '.join(SCENARIOS)}, on a generative config only")
    except (DynbatchdError, OSError, KeyError, ValueError) as exc:   # ours, the disk's, a trace's
        Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(2)
    if out is not None:
        try:
            write_html(data, out, "dynbatchctl capacity " + " ".join(sys.argv[2:]))
        except OSError as exc:
            Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] cannot write {escape(str(out))}: "
                                                       f"{escape(exc.strerror or str(exc))}", highlight=False)
            raise typer.Exit(1) from None
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    elif data.get("generative"):
        render_generative(data, Console(), wide)
    else:
        render(data, Console(), wide)
        if out is not None:
            Console().print(f"summary written to {out}")
