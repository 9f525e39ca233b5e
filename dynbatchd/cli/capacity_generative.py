"""`dynbatchctl capacity` on a generative config: how many devices hold the peak rate with the
requests meeting their channels' TTFT and TPOT targets (`dynbatchd.simulate.generative`), the KV
budget of each by the planner's formula on the profile's memory; and, beside it, how many static
batching would need (what continuous batching saves). Every figure SIMULATED."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from dynbatchd import capacity as cap
from dynbatchd.cli.tables import fit_table, show
from dynbatchd.simulate.generative import config_generative_device, devices_needed


def generative_capacity(cfg: Any, path: Any, traffic: cap.Traffic, profile: str, target: float,
                        scenario: str = "mixed") -> dict[str, Any]:
    kinds = cap.load_pool(profile)
    if len(kinds) != 1:
        raise ValueError("a generative config is sized on one profile (a mixed pool is not modelled for generation)")
    kind = kinds[0]
    device = config_generative_device(cfg, memory_gb=kind.memory_gb)
    devices, trials = devices_needed(cfg, device, rate_per_s=traffic.peak_rps, target=target,
                                     duration_s=traffic.duration_s, seed=traffic.seed, scenario=scenario)
    chosen = next(t for t in trials if t["devices"] == devices)
    try:   # static needs no fewer devices than continuous: the search starts there
        static, static_trials = devices_needed(cfg, device, rate_per_s=traffic.peak_rps, target=target,
                                               duration_s=traffic.duration_s, seed=traffic.seed, scenario=scenario,
                                               mode="static", at_least=devices)
    except ValueError:   # not within the search's 4096 devices
        static, static_trials = None, []
    return {"simulated": True, "generative": True, "config": str(path), "scenario": scenario,
            "traffic": {"requests_per_day": traffic.requests_per_day, "peak_factor": traffic.peak_factor,
                        "peak_rps": traffic.peak_rps, "simulated_seconds": traffic.duration_s, "seed": traffic.seed},
            "profile": {"name": kind.name, "memory_gb": kind.memory_gb, "price_per_hour": kind.price_per_hour,
                        "estimate": kind.estimate},
            "device": device.describe(), "target": target, "devices": devices,
            "monthly_cost": cap.monthly_cost(devices, kind.price_per_hour), "chosen": chosen, "trials": trials,
            "static": {"devices": static, "trials": static_trials,
                       "monthly_cost": None if static is None else cap.monthly_cost(static, kind.price_per_hour)},
            "continuous_saves": None if static is None else round(1 - devices / static, 4)}


def render_generative(data: dict[str, Any], out: Console, wide: bool = False) -> None:
    t, d, p = data["traffic"], data["device"], data["profile"]
    out.print(f"[yellow]SIMULATED[/yellow] generative capacity: {t['requests_per_day']:,.0f} requests/day, peak "
              f"{t['peak_rps']:.1f} req/s ({data['scenario']} workload) on {p['name']} devices: model {d['model']}, "
              f"KV {d['kv_budget_tokens']} tokens ({d['kv_source']}), {d['step_ms']:g} ms/step", highlight=False)
    columns = [("devices", 0), ("met targets", 0), ("overloaded", 1), ("goodput tok/s", 2), ("preemptions", 3)]
    rows = [[str(x["devices"]), f"{100 * x['met_fraction']:.2f}%", f"{100 * x['overloaded_fraction']:.2f}%",
             f"{x['goodput_tokens_per_s']:,.0f}", str(x["preemptions"])] for x in data["trials"]]
    show(out, fit_table("pool sizes tried (SIMULATED)", columns, rows, out, wide), wide)
    out.print(f"{data['devices']} device(s) meet the TTFT/TPOT targets in at least {100 * data['target']:.2f}% of "
              f"requests; ${data['monthly_cost']:,.0f}/month at ${p['price_per_hour']:g}/h"
              f"{' (an ESTIMATE profile)' if p['estimate'] else ''} (SIMULATED)", highlight=False)
    st = data["static"]
    if st["devices"] is None:
        out.print("static batching (a batch runs to its longest member) does not meet the targets within 4096 "
                  "devices (SIMULATED)", highlight=False)
        return
    out.print(f"static batching (a batch runs to its longest member) would need {st['devices']} device(s), "
              f"${st['monthly_cost']:,.0f}/month: continuous batching saves {100 * data['continuous_saves']:.0f}% "
              "of the devices (SIMULATED)", highlight=False)
