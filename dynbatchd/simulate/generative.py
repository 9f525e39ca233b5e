"""Generative channels in `dynbatchctl simulate`, `capacity` and `tune`: a config's causal-lm model
on a simulated device, driven by `dynbatchd.generation.simulation` (reused, not copied).

What the config gives: the channels' ``priority``, ``ttft_ms`` and ``tpot_ms`` (a request counts
as met within both); the causal-lm model's ``simulated`` option (the step costs of
`GenerationLatency`; defaults: a 7B-class model on one GPU), its ``max_batch_sequences``,
``max_prefill_tokens`` and ``mode``, and its KV budget: the ``kv_budget_tokens`` option, else the
planner's formula (`dynbatchd.generation.kv.kv_budget_bytes`) over the model directory's config
and ``[devices] memory_gb``, else the worker's default; each channel's ``queue_limit`` (a request
past it is refused overloaded on arrival, as the daemon refuses it). Every figure is SIMULATED.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from dynbatchd.generation.batching import ChannelTargets, GenRequest
from dynbatchd.generation.kv import kv_budget_tokens_of
from dynbatchd.generation.serving import DEFAULT_KV_BUDGET_TOKENS, NO_TARGET_MS
from dynbatchd.generation.simulation import (OVERLOADED, GenerationLatency, SimulationReport, k12_workload,
                                             mixed_workload, simulate_generation)

RUNNER = "causal-lm"
SCENARIOS = ("mixed", "k12")
MODES = ("continuous", "static")
# The K12 case's channels where the config has none of that name (the guide's targets; the
# daemon's priority: higher first).
K12_DEFAULTS = {"chat": (2, 1000.0, 100.0), "grading": (0, 120_000.0, 500.0)}


@dataclass(frozen=True)
class GenerativeDevice:
    """One simulated device serving a causal-lm model, as the config describes it."""
    model: str
    latency: GenerationLatency
    kv_budget_tokens: int
    kv_source: str
    max_batch: int = 64
    max_prefill_tokens: int = 4096
    mode: str = "continuous"
    tpot_guard: bool = False   # the model's option: the scheduler holds a lower class's prefill for a higher TPOT

    def describe(self) -> dict[str, Any]:
        return {"model": self.model, "kv_budget_tokens": self.kv_budget_tokens, "kv_source": self.kv_source,
                "max_batch_sequences": self.max_batch, "max_prefill_tokens": self.max_prefill_tokens,
                "mode": self.mode, "tpot_guard": self.tpot_guard, "step_ms": self.latency.step_ms,
                "per_seq_ms": self.latency.per_seq_ms,
                "per_kv_token_ms": self.latency.per_kv_token_ms,
                "prefill_ms_per_token": self.latency.prefill_ms_per_token}


def generative_model(cfg: Any, model: str | None = None) -> str | None:
    """`model` if it is a causal-lm model, else the config's first one, else None."""
    if model is not None and model in cfg.models and cfg.models[model].runner == RUNNER:
        return model
    return next((name for name, m in cfg.models.items() if m.runner == RUNNER), None)


def is_generative(cfg: Any) -> bool:
    """Simulated as generative: a causal-lm model and no ``simulated`` one (which the batch simulator models)."""
    return generative_model(cfg) is not None and not any(m.runner == "simulated" for m in cfg.models.values())


def kv_budget_tokens(cfg: Any, model: str, memory_gb: float | None = None) -> tuple[int, str]:
    """(tokens, where from): the option, else the planner's formula on the device memory (`memory_gb`,
    else ``[devices] memory_gb``), else the worker's default."""
    options = cfg.models[model].options
    if "kv_budget_tokens" in options:
        return int(options["kv_budget_tokens"]), "kv_budget_tokens option"
    memory_gb = memory_gb or cfg.devices.memory_gb_of("cuda:0") or cfg.devices.memory_gb_of("cpu")
    dtype = None if options.get("dtype", "auto") == "auto" else options["dtype"]
    tokens = kv_budget_tokens_of(options.get("path"), int((memory_gb or 0) * (1 << 30)), name=model, dtype=dtype)
    if tokens is not None:
        return tokens, f"planner: {memory_gb:g} GB device"
    return DEFAULT_KV_BUDGET_TOKENS, "the worker's default"


def config_generative_device(cfg: Any, model: str | None = None, memory_gb: float | None = None,
                             **latency: float) -> GenerativeDevice:
    """The simulated device of the config's causal-lm model; `latency` (step costs) over its
    ``simulated``; `memory_gb` (a capacity profile's) over ``[devices] memory_gb`` for the KV budget."""
    name = generative_model(cfg, model)
    if name is None:
        raise ValueError(f'no model has runner = "{RUNNER}"')
    options = cfg.models[name].options
    costs = {**options.get("simulated", {}), **latency}
    tokens, source = kv_budget_tokens(cfg, name, memory_gb)
    return GenerativeDevice(name, GenerationLatency(**costs), tokens, source,
                            int(options.get("max_batch_sequences", 64)), int(options.get("max_prefill_tokens", 4096)),
                            options.get("mode", "continuous"), bool(options.get("tpot_guard", False)))


def channel_targets(cfg: Any, scenario: str = "mixed") -> dict[str, ChannelTargets]:
    """Each channel's targets in the generation scheduler's terms (its priority: lower first, so the
    config's is negated); a channel without ttft_ms / tpot_ms has no target. The K12 scenario adds
    chat and grading where the config lacks them."""
    out = {name: ChannelTargets(name, -ch.priority, ch.ttft_ms or NO_TARGET_MS, ch.tpot_ms or NO_TARGET_MS)
           for name, ch in cfg.channels.items()}
    if scenario == "k12":
        for name, (priority, ttft, tpot) in K12_DEFAULTS.items():
            out.setdefault(name, ChannelTargets(name, -priority, ttft, tpot))
    return out


def queue_limits(cfg: Any, devices: int = 1) -> dict[str, int]:
    """Each channel's ``queue_limit`` on one of `devices` devices sharing the load evenly: the daemon
    counts a channel's generate jobs over all its devices (one daemon holding them all, its
    hand-over picking the least-loaded worker), so a device holds its share, rounded up. A K12
    channel the config lacks has none."""
    return {name: math.ceil(ch.queue_limit / devices) for name, ch in cfg.channels.items()}


def generative_channels(cfg: Any) -> tuple[str, ...]:
    """The channels the mixed workload offers traffic to: those with a ttft_ms or tpot_ms, else the default."""
    named = tuple(n for n, ch in cfg.channels.items() if ch.ttft_ms is not None or ch.tpot_ms is not None)
    return named or (cfg.routing.default,)


def workload(cfg: Any, scenario: str, rate_per_s: float, requests: int, seed: int) -> list[GenRequest]:
    """The scenario's requests, each due at its arrival + its channel's ``deadline_ms`` as the
    daemon's intake sets it (the worker ends a generation still running then: deadline_exceeded);
    a K12 channel the config lacks has none."""
    if scenario == "k12":
        drawn = k12_workload(requests, rate_per_s=rate_per_s, seed=seed)
    elif scenario == "mixed":
        drawn = mixed_workload(requests, rate_per_s=rate_per_s, seed=seed, channels=generative_channels(cfg))
    else:
        raise ValueError(f"unknown scenario {scenario!r} (known: {', '.join(SCENARIOS)})")
    due = {name: ch.deadline_ms for name, ch in cfg.channels.items()}
    return [replace(r, deadline_ms=r.arrival_ms + due[r.channel]) if r.channel in due else r for r in drawn]


def run_generative(cfg: Any, device: GenerativeDevice, *, scenario: str = "mixed", mode: str | None = None,
                   rate_per_s: float, requests: int, seed: int = 1, tpot_guard: bool | None = None,
                   devices: int = 1, **overrides: int) -> SimulationReport:
    """One simulated device (of `devices`: its share of the queue limits) under `requests` arrivals
    at `rate_per_s`; `overrides`: max_batch, max_prefill_tokens (what `tune` tries); `tpot_guard`
    None: the model's option. The guard uses the latency model's step estimate, where the live
    loop learns one from its steps."""
    kw = dict(max_batch=device.max_batch, max_prefill_tokens=device.max_prefill_tokens)
    kw.update(overrides)
    return simulate_generation(workload(cfg, scenario, rate_per_s, requests, seed), channel_targets(cfg, scenario),
                               mode=mode or device.mode, kv_budget_tokens=device.kv_budget_tokens,
                               latency=device.latency,
                               tpot_guard=device.tpot_guard if tpot_guard is None else tpot_guard,
                               queue_limits=queue_limits(cfg, devices), **kw)


def per_channel(report: SimulationReport) -> dict[str, dict[str, Any]]:
    """Per channel: requests, met targets, their share, those refused overloaded, and p50/p99 TTFT
    and mean TPOT (ms)."""
    out: dict[str, dict[str, Any]] = {}
    for name in sorted({f.channel for f in report.finished}):
        done = [f for f in report.finished if f.channel == name]
        ttfts = sorted(f.ttft_ms for f in done if f.ttft_ms is not None)
        tpots = [f.tpot_ms for f in done if f.tpot_ms is not None]
        met = sum(1 for f in done if report.met(f))
        out[name] = {"requests": len(done), "met": met, "met_fraction": round(met / len(done), 4),
                     "overloaded": sum(1 for f in done if f.reason == OVERLOADED),
                     "ttft_p50_ms": round(_pick(ttfts, 0.50), 1), "ttft_p99_ms": round(_pick(ttfts, 0.99), 1),
                     "tpot_mean_ms": round(sum(tpots) / len(tpots), 2) if tpots else 0.0}
    return out


def met_fraction(report: SimulationReport) -> float:
    return sum(1 for f in report.finished if report.met(f)) / len(report.finished) if report.finished else 1.0


def _pick(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def trial(cfg: Any, device: GenerativeDevice, devices: int, rate_per_s: float, duration_s: float, seed: int,
          scenario: str = "mixed", mode: str | None = None) -> dict[str, Any]:
    """`devices` devices sharing `rate_per_s` evenly: one device simulated at rate / devices."""
    each = rate_per_s / devices
    report = run_generative(cfg, device, scenario=scenario, mode=mode, rate_per_s=each,
                            requests=max(1, round(each * duration_s)), seed=seed, devices=devices)
    return {"devices": devices, "met_fraction": round(met_fraction(report), 4),
            "goodput_tokens_per_s": round(report.goodput_tokens_per_s * devices, 1),
            "preemptions": report.preemptions, "overloaded": report.overloaded,
            "overloaded_fraction": round(report.overloaded / len(report.finished), 4) if report.finished else 0.0,
            "channels": per_channel(report)}


def decode_bound(cfg: Any, device: GenerativeDevice, rate_per_s: float, scenario: str, seed: int) -> int:
    """Devices the offered output tokens need at the least: a device decodes at most max_batch
    tokens a step of at least step_ms + per_seq_ms × max_batch."""
    sample = workload(cfg, scenario, rate_per_s, 500, seed)
    offered = rate_per_s * sum(r.max_new_tokens for r in sample) / len(sample)
    best = 1000.0 * device.max_batch / (device.latency.step_ms + device.latency.per_seq_ms * device.max_batch)
    return max(1, int(offered / best)) if best > 0 else 1


def devices_needed(cfg: Any, device: GenerativeDevice, *, rate_per_s: float, target: float = 0.99,
                   duration_s: float = 20.0, seed: int = 1, scenario: str = "mixed", mode: str | None = None,
                   max_devices: int = 4096, at_least: int | None = None) -> tuple[int, list[dict[str, Any]]]:
    """The fewest devices whose requests meet their TTFT and TPOT targets in at least `target` of
    cases (doubling from `at_least`, then bisection), and every trial run; ValueError past
    `max_devices`. `at_least`: a known lower bound (static needs no fewer than continuous), so
    the search skips the small pools whose backlogs are the slowest to simulate; None: half of
    `decode_bound`, which no pool below can meet."""
    tried: dict[int, dict[str, Any]] = {}

    def ok(n: int) -> bool:
        tried[n] = trial(cfg, device, n, rate_per_s, duration_s, seed, scenario, mode)
        return tried[n]["met_fraction"] >= target

    if at_least is None:
        at_least = max(1, decode_bound(cfg, device, rate_per_s, scenario, seed) // 2)
    low, high = at_least - 1, at_least      # low: failed, or taken to
    while not ok(high):
        if high >= max_devices:
            raise ValueError(f"{max_devices} devices do not meet the targets in {target:.2%} of requests")
        low, high = high, min(2 * high, max_devices)
    while high - low > 1:
        mid = (low + high) // 2
        if ok(mid):
            high = mid
        else:
            low = mid
    return high, [tried[n] for n in sorted(tried)]
