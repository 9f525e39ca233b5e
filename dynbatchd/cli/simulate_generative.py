"""`dynbatchctl simulate` on a generative config: its causal-lm model on simulated devices
(`dynbatchd.simulate.generative`), continuous against static batching. Every figure SIMULATED."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from dynbatchd.cli.tables import fit_table, show
from dynbatchd.generation.serving import NO_TARGET_MS
from dynbatchd.simulate.generative import MODES, channel_targets, config_generative_device, per_channel, run_generative


def generative_data(cfg: Any, path: Path | str, *, scenario: str, modes: tuple[str, ...], rate: float,
                    duration: float, devices: int, seed: int, latency: dict[str, float]) -> dict[str, Any]:
    """The figures `simulate` shows: devices share the load evenly, so one device is simulated at
    rate / devices (with its share of each channel's queue_limit) and the totals are that device's
    times `devices`."""
    device = config_generative_device(cfg, **latency)
    each = rate / devices
    requests = max(1, round(each * duration))
    data: dict[str, Any] = {"simulated": True, "generative": True, "config": str(path), "scenario": scenario,
                            "devices": devices, "rate_per_s": rate, "requests_per_device": requests,
                            "device": device.describe(), "modes": {},
                            "targets": {name: {"priority": -t.priority,
                                               "ttft_ms": None if t.ttft_ms >= NO_TARGET_MS else t.ttft_ms,
                                               "tpot_ms": None if t.tpot_ms >= NO_TARGET_MS else t.tpot_ms}
                                        for name, t in channel_targets(cfg, scenario).items()}}
    for mode in modes:
        report = run_generative(cfg, device, scenario=scenario, mode=mode, rate_per_s=each, requests=requests,
                                seed=seed, devices=devices)
        summary = report.summary()
        summary["total_goodput_tokens_per_s"] = round(summary["goodput_tokens_per_s"] * devices, 1)
        summary["channels"] = per_channel(report)
        data["modes"][mode] = summary
    return data


def show_generative(data: dict[str, Any], as_json: bool, wide: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return
    out, d = Console(), data["device"]
    out.print(f"[yellow]SIMULATED[/yellow] generation: {data['scenario']} workload, {data['rate_per_s']:g} req/s "
              f"over {data['devices']} simulated device(s) ({data['requests_per_device']} requests each) of model "
              f"{d['model']}: {d['step_ms']:g} ms/step + {d['per_seq_ms']:g} ms/sequence + "
              f"{d['prefill_ms_per_token']:g} ms/prefill token; KV {d['kv_budget_tokens']} tokens ({d['kv_source']}); "
              f"channels from {data['config']}", highlight=False)
    columns = [("mode", 0), ("channel", 0), ("requests", 3), ("met targets", 0), ("overloaded", 1),
               ("TTFT p50 ms", 4), ("TTFT p99 ms", 0), ("TPOT ms", 2)]
    rows = [[mode, name, str(c["requests"]), f"{c['met']} ({100 * c['met_fraction']:.1f}%)", str(c["overloaded"]),
             f"{c['ttft_p50_ms']:.1f}", f"{c['ttft_p99_ms']:.1f}", f"{c['tpot_mean_ms']:.2f}"]
            for mode, s in data["modes"].items() for name, c in s["channels"].items()]
    show(out, fit_table("generative channels (SIMULATED)", columns, rows, out, wide, left={"mode", "channel"}), wide)
    for mode, s in data["modes"].items():
        peak = s["kv_peak_bytes"] / s["kv_budget_bytes"] if s["kv_budget_bytes"] else 0.0
        out.print(f"{mode}: goodput {s['total_goodput_tokens_per_s']:g} tokens/s within targets "
                  f"({s['met_targets']}/{s['requests']} requests a device), {s['tokens_per_s']:g} tokens/s a device "
                  f"in all, {s['overloaded']} refused overloaded (queue_limit), {s['preemptions']} preemptions, "
                  f"KV peak {100 * peak:.0f}% of budget (SIMULATED)",
                  highlight=False)


def modes_of(mode: str) -> tuple[str, ...]:
    if mode == "both":
        return MODES
    if mode not in MODES:
        raise ValueError(f"--mode must be continuous, static or both, got {mode!r}")
    return (mode,)
