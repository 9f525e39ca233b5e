"""`dynbatchctl tune CHANNEL --generative`: recommend a causal-lm model's step limits for a
generative channel, by simulation (`dynbatchd.simulate.generative`), offline.

The knobs are the model's runner options (``max_batch_sequences``, ``max_prefill_tokens``), not the
channel's, so this changes nothing: it tries a grid of them on the config's simulated device at
the offered rate and prints the best, to put in ``[models.NAME] options`` (a reload applies them).
Best: the most of CHANNEL's requests within its ttft_ms and tpot_ms, then the most goodput of all
channels, then the current settings, then the smaller. Every figure SIMULATED.
"""

from __future__ import annotations

from typing import Any

from dynbatchd import config as cfgmod
from dynbatchd.simulate.generative import config_generative_device, per_channel, run_generative, workload

SEQUENCES = (8, 16, 32, 64, 128, 256)
PREFILL = (512, 1024, 2048, 4096, 8192, 16384)


def recommend_generative(cfg: Any, channel: str, *, rate_per_s: float, duration_s: float, seed: int,
                         scenario: str = "mixed") -> dict[str, Any]:
    if channel not in cfg.channels:
        raise ValueError(f"no channel {channel!r} in the config")
    device = config_generative_device(cfg)
    requests = max(1, round(rate_per_s * duration_s))
    offered = sorted({r.channel for r in workload(cfg, scenario, rate_per_s, requests, seed)})
    if channel not in offered:   # every trial would score 0 for it: say so rather than pick by the others
        raise ValueError(f"channel {channel!r} gets none of the {scenario} workload's requests (it offers them "
                         f"to {', '.join(offered)}: the channels with ttft_ms or tpot_ms, else the default)")
    trials = []
    for seqs in SEQUENCES:
        for prefill in PREFILL:
            report = run_generative(cfg, device, scenario=scenario, rate_per_s=rate_per_s, requests=requests,
                                    seed=seed, max_batch=seqs, max_prefill_tokens=prefill)
            mine = per_channel(report).get(channel, {"met_fraction": 0.0, "requests": 0})
            trials.append({"max_batch_sequences": seqs, "max_prefill_tokens": prefill,
                           "channel_met_fraction": mine["met_fraction"], "channel_requests": mine["requests"],
                           "goodput_tokens_per_s": round(report.goodput_tokens_per_s, 1),
                           "preemptions": report.preemptions})
    now = (device.max_batch, device.max_prefill_tokens)
    best = max(trials, key=lambda t: (t["channel_met_fraction"], t["goodput_tokens_per_s"],
                                      (t["max_batch_sequences"], t["max_prefill_tokens"]) == now,
                                      -t["max_batch_sequences"], -t["max_prefill_tokens"]))
    current = next(t for t in trials if (t["max_batch_sequences"], t["max_prefill_tokens"])
                   == (device.max_batch, device.max_prefill_tokens)) if (
        device.max_batch in SEQUENCES and device.max_prefill_tokens in PREFILL) else None
    return {"simulated": True, "generative": True, "channel": channel, "model": device.model,
            "scenario": scenario, "rate_per_s": rate_per_s, "requests": requests, "device": device.describe(),
            "current": current, "recommended": best, "trials": trials}


def run_tune_generative(ctx: Any, channel: str, rate: float, duration: float, seed: int, as_json: bool) -> None:
    from dynbatchd.cli import limits
    from dynbatchd.cli.output import emit_json, fail, out
    limits.check_volume(rate, duration, "--rate × --duration")
    path = cfgmod.find_config(getattr(ctx.obj, "config", None))
    try:
        if path is None:
            raise ValueError(f"no config file found (searched {cfgmod.search_order_text()})")
        data = recommend_generative(cfgmod.load(path), channel, rate_per_s=rate, duration_s=duration, seed=seed)
    except (cfgmod.ConfigError, OSError, ValueError) as exc:
        raise fail(str(exc), 2) from None
    if as_json:
        return emit_json(data)
    best, now = data["recommended"], data["current"]
    out.print(f"[yellow]SIMULATED[/yellow] {len(data['trials'])} settings of model {data['model']} at "
              f"{rate:g} req/s ({data['requests']} requests, {data['scenario']} workload), judged by channel "
              f"{channel}'s TTFT/TPOT targets, then goodput:", highlight=False)
    if now is not None:
        out.print(f"  now:         max_batch_sequences = {now['max_batch_sequences']}, max_prefill_tokens = "
                  f"{now['max_prefill_tokens']}: {100 * now['channel_met_fraction']:.1f}% within targets, "
                  f"goodput {now['goodput_tokens_per_s']:g} tok/s", highlight=False)
    out.print(f"  recommended: max_batch_sequences = {best['max_batch_sequences']}, max_prefill_tokens = "
              f"{best['max_prefill_tokens']}: {100 * best['channel_met_fraction']:.1f}% within targets, "
              f"goodput {best['goodput_tokens_per_s']:g} tok/s", highlight=False)
    out.print(f"nothing changed: these are \\[models.{data['model']}] options; set them in the config and reload",
              highlight=False)
