"""Adaptive batching versus the best fixed setting: the issue's three benchmarks.

    python -m benchmarks.adaptive            # phased grid, K12 surge, Azure trace (simulated)
    python -m benchmarks.adaptive --quick    # shorter traces, same shape (~10 s)
    python -m benchmarks.adaptive --replay   # also replay the Azure trace through the live daemon

1. Phased trace (steady low -> burst ×4 -> steady medium, tokens 7:2:1) on one simulated
   accelerator (8 ms + 0.5 ms/item): the guide's grid of fixed settings (batch 4/8/16/32 ×
   window 10/50/100/200 ms) and every registered adaptive policy on the same trace.
2. K12 evening surge on four simulated accelerators: three channels (realtime 16/30 ms,
   standard 32/100 ms, bulk 8/500 ms; tokens > 8192 -> bulk, tag urgent -> realtime) versus one
   FIFO queue on the same devices.
3. The Azure LLM conversation trace (busiest span, time-compressed so its busiest minutes exceed
   the device): simulated grid and adaptive policies, and with --replay each adaptive policy and
   the best fixed setting replayed through the real daemon (`dynbatchd start`) on the simulated
   runner.

Policies are picked up by name from the plugin registry at run time (`Plugins.load()`), so
whatever window policies and batch sizers are installed are benchmarked. Every figure comes from
a simulated device and is labelled SIMULATED. Results also go to benchmarks/results/adaptive.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from benchmarks import loadgen, traces
from benchmarks.harness import Daemon, ipc_daemon
from dynbatchd.config import ChannelSettings, PolicySettings
from dynbatchd.plugins import Plugins
from dynbatchd.simulate import DeviceModel, SimResult, simulate
from dynbatchd.telemetry import goodput_rps, on_time_fraction

SIM = "SIMULATED"
REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
GRID_BATCH = (4, 8, 16, 32)
GRID_WINDOW = (10, 50, 100, 200)
EPS = 1e-9


# ---------------------------------------------------------------------------
# policies
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Setup:
    """One way to configure a channel's batching: a window policy and a batch sizer."""
    name: str
    window: str = "fixed"
    sizer: str = "static"
    max_batch: int = 32
    window_ms: float = 50.0
    window_options: tuple = ()
    sizer_options: tuple = ()

    @property
    def adaptive(self) -> bool:
        return self.window != "fixed" or self.sizer != "static"

    def settings(self, **base: Any) -> ChannelSettings:
        kw = dict(base)
        kw["max_batch"] = self.max_batch
        kw["window_ms"] = self.window_ms
        if self.window != "fixed":
            kw["window"] = PolicySettings(policy=self.window, options=dict(self.window_options))
        if self.sizer != "static":
            kw["batch_size"] = PolicySettings(policy=self.sizer, options=dict(self.sizer_options))
        return ChannelSettings(**kw)

    def toml(self) -> str:
        """The channel keys that select this setup in a dynbatchd.toml."""
        lines = [f"max_batch = {self.max_batch}", f"window_ms = {self.window_ms:g}"]
        if self.window != "fixed":
            lines.append(f'window = {{ policy = "{self.window}", options = {_toml_table(dict(self.window_options))} }}')
        if self.sizer != "static":
            lines.append(f'batch_size = {{ policy = "{self.sizer}", options = {_toml_table(dict(self.sizer_options))} }}')
        return "\n".join(lines)


def _toml_table(d: dict[str, Any]) -> str:
    return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in d.items()) + " }" if d else "{}"


@dataclass
class Registry:
    windows: dict[str, Any]
    sizers: dict[str, Any]
    plugins: Plugins

    @classmethod
    def load(cls) -> "Registry":
        plugins = Plugins.load()
        return cls(plugins.window_policies(), plugins.batch_sizers(), plugins)

    def adaptive_setups(self, max_batch: int, window_ms: float) -> list[Setup]:
        """Every registered adaptive window (static sizer), every adaptive sizer with the fixed
        window and with each adaptive window."""
        out = []
        wins = sorted(w for w in self.windows if w != "fixed")
        sizes = sorted(s for s in self.sizers if s != "static")
        for w in wins:
            out.append(Setup(w, window=w, max_batch=max_batch, window_ms=window_ms))
        for s in sizes:
            out.append(Setup(f"fixed {window_ms:g}ms + {s}", sizer=s, max_batch=max_batch, window_ms=window_ms))
            for w in wins:
                out.append(Setup(f"{w} + {s}", window=w, sizer=s, max_batch=max_batch, window_ms=window_ms))
        return out


def fixed_grid() -> list[Setup]:
    return [Setup(f"fixed b{b}/w{w}", max_batch=b, window_ms=w) for b in GRID_BATCH for w in GRID_WINDOW]


def run_sim(reg: Registry, channels: dict[str, ChannelSettings], trace: traces.Trace, **kw: Any) -> SimResult:
    return simulate(channels, trace.arrivals, window_policies=reg.windows, sizers=reg.sizers, **kw)


# ---------------------------------------------------------------------------
# formatting
# ---------------------------------------------------------------------------

def fmt_ms(v: float) -> str:
    if v is None or not math.isfinite(v):
        return "inf"
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def fmt_ratio(v: float) -> str:
    return "inf" if not math.isfinite(v) else f"{v:.2f}x"


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def ratio(a: float, b: float) -> float:
    if b == 0:
        return math.inf if a > 0 else 1.0
    return a / b


# ---------------------------------------------------------------------------
# 1. phased trace
# ---------------------------------------------------------------------------

PHASED_DEVICE = DeviceModel(base_ms=8.0, per_item_ms=0.5)
PHASED_SLO_MS = 200.0


def bench_phased(reg: Registry, quick: bool, log=print, inflight: int = 2) -> dict[str, Any]:
    trace = traces.phased(seconds=(2.0, 1.0, 2.0) if quick else (4.0, 2.0, 4.0))
    base = dict(deadline_ms=PHASED_SLO_MS, queue_limit=4096)
    setups = fixed_grid() + reg.adaptive_setups(max_batch=32, window_ms=50)
    lo, hi = trace.phases[0][1], trace.phases[-1][2]
    rows = []
    t0 = time.perf_counter()
    for setup in setups:
        try:
            r = run_sim(reg, {"standard": setup.settings(**base)}, trace, device=PHASED_DEVICE, devices=1,
                        inflight=inflight)
        except (ValueError, TypeError, KeyError) as exc:
            rows.append({"setup": setup.name, "adaptive": setup.adaptive, "error": f"{type(exc).__name__}: {exc}"})
            continue
        total = r.total(lo, hi)
        row = {"setup": setup.name, "adaptive": setup.adaptive, "goodput_rps": total.goodput_rps,
               "on_time": total.on_time_fraction, "p99_ms": total.p99_success_ms,
               "mean_batch": r.mean_batch(), "utilisation": r.utilisation(lo, hi),
               "expired": total.expired, "overloaded": total.overloaded, "late": total.late, "phases": {}}
        for name, plo, phi in trace.phases:
            g = r.total(plo, phi)
            row["phases"][name] = {"p99_ms": g.p99_success_ms, "p50_ms": g.p50_ms,
                                   "goodput_rps": g.goodput_rps, "on_time": g.on_time_fraction,
                                   "utilisation": r.utilisation(plo, phi)}
        rows.append(row)
    elapsed = time.perf_counter() - t0
    ok = [r for r in rows if "error" not in r]
    fixed = [r for r in ok if not r["adaptive"]]
    best = max(fixed, key=lambda r: (r["goodput_rps"], -r["p99_ms"]))
    phase_names = [p[0] for p in trace.phases]
    best_phase = {p: min(fixed, key=lambda r: (r["phases"][p]["p99_ms"], -r["phases"][p]["goodput_rps"]))
                  for p in phase_names}
    verdicts = []
    for r in ok:
        if not r["adaptive"]:
            continue
        g_ratio = ratio(r["goodput_rps"], best["goodput_rps"])
        p_ratios = {p: ratio(r["phases"][p]["p99_ms"], best_phase[p]["phases"][p]["p99_ms"]) for p in phase_names}
        goodput_met = r["goodput_rps"] >= best["goodput_rps"] * (1 - EPS)
        p99_met = {p: v <= 1.10 + EPS for p, v in p_ratios.items()}
        verdicts.append({"setup": r["setup"], "goodput_ratio": g_ratio, "goodput_met": goodput_met,
                         "p99_ratio": p_ratios, "p99_met": p99_met,
                         "met": goodput_met and all(p99_met.values())})

    if inflight != 2:
        log(f"\n-- what-if: the same trace with {inflight} batch(es) in flight per device (the daemon ships 2) --")
        if verdicts:
            log(_verdict_table(verdicts, phase_names, best, best_phase))
        return {"inflight": inflight, "rows": rows, "best_fixed": best["setup"],
                "best_fixed_per_phase": {p: best_phase[p]["setup"] for p in phase_names}, "verdicts": verdicts,
                "simulated": True, "elapsed_s": elapsed}
    log(f"\n== 1. Phased trace [{SIM}] ==")
    log(f"trace: {trace.description}; {len(trace.arrivals)} requests over {trace.duration_s:g} s")
    log(f"device [{SIM}]: 1 accelerator, {PHASED_DEVICE.base_ms:g} ms + {PHASED_DEVICE.per_item_ms:g} ms/item, "
        f"2 batches in flight; SLO = deadline {PHASED_SLO_MS:g} ms; goodput = completions within the SLO per "
        f"second of trace; p99 = time to a successful answer, a request never completed (expired, overloaded) "
        f"counting as +inf (so dropping work cannot improve it)")
    headers = ["setup", "goodput rps", "on-time", *[f"p99 {p} ms" for p in phase_names], "p99 all ms",
               "mean batch", "util", "expired", "overl."]
    trows = []
    for r in rows:
        if "error" in r:
            trows.append([r["setup"], "error", r["error"][:60]] + [""] * (len(headers) - 3))
            continue
        trows.append([r["setup"] + (" *" if r["adaptive"] else ""), f"{r['goodput_rps']:.1f}", f"{r['on_time']:.2%}",
                      *[fmt_ms(r["phases"][p]["p99_ms"]) for p in phase_names], fmt_ms(r["p99_ms"]),
                      f"{r['mean_batch']:.1f}", f"{r['utilisation']:.0%}", r["expired"], r["overloaded"]])
    log(table(headers, trows))
    log(f"(* adaptive; {len(rows)} runs of {len(trace.arrivals)} requests simulated in {elapsed:.2f} s)")
    if verdicts:
        log(_verdict_table(verdicts, phase_names, best, best_phase))
        log("goal: goodput >= 1.00x the best fixed setting's, and in every phase p99 <= 1.10x that phase's best fixed p99")
    else:
        log("no adaptive policy is registered (only fixed/static): nothing to compare")
    return {"trace": trace.description, "requests": len(trace.arrivals), "device": PHASED_DEVICE.options(),
            "slo_ms": PHASED_SLO_MS, "rows": rows, "best_fixed": best["setup"],
            "best_fixed_per_phase": {p: best_phase[p]["setup"] for p in phase_names},
            "verdicts": verdicts, "simulated": True, "elapsed_s": elapsed}


def _verdict_table(verdicts: list[dict[str, Any]], phase_names: list[str], best: dict[str, Any],
                   best_phase: dict[str, Any]) -> str:
    head = (f"best fixed goodput: {best['setup']} {best['goodput_rps']:.1f} rps; best fixed p99 per phase: "
            + ", ".join(f"{p} {best_phase[p]['setup']} {fmt_ms(best_phase[p]['phases'][p]['p99_ms'])} ms"
                        for p in phase_names))
    vrows = [[v["setup"], fmt_ratio(v["goodput_ratio"]), *[fmt_ratio(v["p99_ratio"][p]) for p in phase_names],
              "MET" if v["met"] else "missed"] for v in verdicts]
    return head + "\n" + table(["adaptive vs best fixed", "goodput", *[f"p99 {p}" for p in phase_names], "goal"], vrows)


# ---------------------------------------------------------------------------
# 2. K12 evening surge
# ---------------------------------------------------------------------------

K12_DEVICE = DeviceModel(base_ms=8.0, per_item_ms=0.5, per_token_ms=0.002)
K12_DEVICES = 4
# [routing] as a file spells it: the core's default and the routing plugin's rules (dynbatchd.config.shared)
K12_ROUTING = {"default": "standard", "rules": [{"channel": "bulk", "tokens_above": 8192},
                                                {"channel": "realtime", "tag": "urgent"}]}


def k12_channels(window: str = "fixed", sizer: str = "static") -> dict[str, ChannelSettings]:
    def sel(policy: str) -> PolicySettings | None:
        return PolicySettings(policy=policy) if policy not in ("fixed", "static") else None
    common = {"window": sel(window), "batch_size": sel(sizer)}
    return {"realtime": ChannelSettings(max_batch=16, window_ms=30, deadline_ms=200, queue_limit=1024, priority=2, **common),
            "standard": ChannelSettings(max_batch=32, window_ms=100, deadline_ms=1000, queue_limit=4096, priority=1, **common),
            "bulk": ChannelSettings(max_batch=8, window_ms=500, deadline_ms=30000, queue_limit=4096, min_share=0.05, **common)}


def k12_fifo() -> dict[str, ChannelSettings]:
    return {"fifo": ChannelSettings(max_batch=32, window_ms=100, deadline_ms=30000, queue_limit=9216)}


K12_LOADS = ((330.0, "surge to ~85-90% utilisation"), (400.0, "saturating surge (offered ~ capacity)"))


def k12_runs(reg: Registry) -> list[tuple[str, dict[str, ChannelSettings], dict[str, Any]]]:
    """(name, channels, simulate options): the daemon as configured, then what-ifs of core changes."""
    fifo_route = {"route": lambda a: "fifo"}
    runs = [("3 channels, fixed (guide)", k12_channels(), {}),
            ("single FIFO queue", k12_fifo(), fifo_route)]
    for w in sorted(x for x in reg.windows if x != "fixed"):
        runs.append((f"3 channels, window {w}", k12_channels(window=w), {}))
    for sz in sorted(x for x in reg.sizers if x != "static"):
        runs.append((f"3 channels, sizer {sz}", k12_channels(sizer=sz), {}))
    runs.append(("what-if: fixed, 1 batch in flight", k12_channels(), {"inflight": 1, "what_if": True}))
    runs.append(("what-if: FIFO, 1 batch in flight", k12_fifo(), {**fifo_route, "inflight": 1, "what_if": True}))
    no_share = k12_channels()
    no_share["bulk"] = msgspec.structs.replace(no_share["bulk"], min_share=0.0)
    runs.append(("what-if: 1 in flight + bulk min_share 0", no_share, {"inflight": 1, "what_if": True}))
    return runs


def bench_k12(reg: Registry, quick: bool, log=print) -> dict[str, Any]:
    out: dict[str, Any] = {"devices": K12_DEVICES, "device": K12_DEVICE.options(), "simulated": True, "loads": []}
    log(f"\n== 2. K12 evening surge [{SIM}] ==")
    log(f"devices [{SIM}]: {K12_DEVICES} accelerators, {K12_DEVICE.base_ms:g} ms + {K12_DEVICE.per_item_ms:g} ms/item + "
        f"{K12_DEVICE.per_token_ms * 1000:g} µs/token (a batch of 8 essays ~ 200 ms), 2 batches in flight each "
        f"(the daemon's default); channels realtime 16/30 ms (deadline 200 ms, priority 2), standard 32/100 ms "
        f"(1 s, priority 1), bulk 8/500 ms (30 s, min_share 0.05); FIFO: one channel 32/100 ms, deadline 30 s "
        f"(arrival order). SLO per class: realtime 200 ms, standard 1 s, bulk 30 s, for both layouts.")
    for base_rps, what in K12_LOADS:
        trace = traces.k12_surge(base_rps=base_rps, surge_s=8.0 if quick else 20.0, before_s=3.0 if quick else 4.0,
                                 after_s=4.0 if quick else 6.0)
        slo, shi = trace.phase("surge")
        rows = []
        t0 = time.perf_counter()
        for name, channels, opts in k12_runs(reg):
            opts = dict(opts)
            what_if = opts.pop("what_if", False)
            kw = {"device": K12_DEVICE, "devices": K12_DEVICES, "inflight": 2, "routing": K12_ROUTING,
                  "plugins": reg.plugins, **opts}
            try:
                r = run_sim(reg, channels, trace, **kw)
            except (ValueError, TypeError, KeyError) as exc:
                rows.append({"setup": name, "error": f"{type(exc).__name__}: {exc}"})
                continue
            per = r.stats("label")
            total = r.total()
            row = {"setup": name, "what_if": what_if, "utilisation_surge": r.utilisation(slo, shi),
                   "utilisation_all": r.utilisation(), "goodput_rps": total.goodput_rps,
                   "classes": {label: per[label].as_dict() for label in ("realtime", "standard", "bulk") if label in per}}
            bulk = per["bulk"]
            row["bulk_completed"] = bulk.completed / bulk.offered if bulk.offered else 1.0
            row["goal_realtime"] = per["realtime"].on_time_fraction >= 0.9995
            row["goal_util"] = row["utilisation_surge"] >= 0.85
            row["goal_bulk"] = row["bulk_completed"] >= 0.99
            row["met"] = row["goal_realtime"] and row["goal_util"] and row["goal_bulk"]
            rows.append(row)
        elapsed = time.perf_counter() - t0
        counts = {c: sum(1 for a in trace.arrivals if a.label == c) for c in ("realtime", "standard", "bulk")}
        log(f"\n-- load: {what}: {trace.description}; {len(trace.arrivals)} requests "
            f"({', '.join(f'{k} {v}' for k, v in counts.items())})")
        headers = ["setup", "rt on-time", "rt p99 ms", "std on-time", "std p99 ms", "bulk done", "bulk p99 ms",
                   "util surge", "goodput rps", "goal"]
        trows = []
        for row in rows:
            if "error" in row:
                trows.append([row["setup"], "error", row["error"][:60]] + [""] * (len(headers) - 3))
                continue
            c = row["classes"]
            p99 = lambda k: fmt_ms(c[k]["p99_success_ms"] if c[k]["p99_success_ms"] is not None else math.inf)
            trows.append([row["setup"], f"{c['realtime']['on_time_fraction']:.3%}", p99("realtime"),
                          f"{c['standard']['on_time_fraction']:.2%}", p99("standard"),
                          f"{row['bulk_completed']:.1%}", p99("bulk"),
                          f"{row['utilisation_surge']:.1%}", f"{row['goodput_rps']:.0f}",
                          "MET" if row["met"] else "missed"])
        log(table(headers, trows))
        log(f"({len(rows)} runs simulated in {elapsed:.2f} s; what-if rows change the simulated daemon, not a setting)")
        out["loads"].append({"base_rps": base_rps, "what": what, "trace": trace.description,
                             "requests": len(trace.arrivals), "rows": rows, "elapsed_s": elapsed})
    log("goal: realtime on-time >= 99.95% (of all offered realtime requests; late, expired and overloaded all "
        "count as misses) with device utilisation >= 85% during the surge, and bulk completing (>= 99% answered "
        "with a result)")
    return out


# ---------------------------------------------------------------------------
# 3. Azure trace: simulated, and replayed through the live daemon
# ---------------------------------------------------------------------------

AZURE_DEVICE = DeviceModel(base_ms=8.0, per_item_ms=0.5, per_token_ms=0.0011)
AZURE_ROUTING = {"default": "standard", "rules": [{"channel": "bulk", "tokens_above": 8192}]}   # as K12_ROUTING
AZURE_COMPRESS = 60.0


def azure_trace(quick: bool) -> traces.Trace:
    """Minutes 24-34 of the hour (386..507 requests a minute; quick: minutes 25-30), one minute -> one second."""
    if quick:
        return traces.azure_conv(compress=AZURE_COMPRESS, start_s=25 * 60.0, span_s=300.0)
    return traces.azure_conv(compress=AZURE_COMPRESS, start_s=24 * 60.0, span_s=600.0)


def azure_channels(setup: Setup) -> dict[str, ChannelSettings]:
    return {"standard": setup.settings(deadline_ms=1000, queue_limit=4096, priority=1),
            "bulk": ChannelSettings(max_batch=8, window_ms=500, deadline_ms=30000, queue_limit=4096, min_share=0.05)}


def azure_row(setup: Setup, r: SimResult, trace: traces.Trace) -> dict[str, Any]:
    lo, hi = trace.phases[0][1], trace.phases[-1][2]
    per = r.stats("channel", lo, hi)
    total = r.total(lo, hi)
    return {"setup": setup.name, "adaptive": setup.adaptive, "goodput_rps": total.goodput_rps,
            "on_time": total.on_time_fraction, "p99_ms": total.p99_success_ms, "utilisation": r.utilisation(lo, hi),
            "channels": {c: g.as_dict() for c, g in sorted(per.items())}}


def bench_azure_sim(reg: Registry, quick: bool, log=print) -> dict[str, Any] | None:
    if not traces.azure_available():
        log(f"\n== 3. Azure trace: skipped, {traces.AZURE_CSV} not found ==")
        return None
    trace = azure_trace(quick)
    setups = fixed_grid() + reg.adaptive_setups(max_batch=32, window_ms=50)
    rows, by_name = [], {}
    t0 = time.perf_counter()
    for setup in setups:
        try:
            r = run_sim(reg, azure_channels(setup), trace, device=AZURE_DEVICE, devices=1, inflight=2,
                        routing=AZURE_ROUTING, plugins=reg.plugins)
        except (ValueError, TypeError, KeyError) as exc:
            rows.append({"setup": setup.name, "adaptive": setup.adaptive, "error": f"{type(exc).__name__}: {exc}"})
            continue
        row = azure_row(setup, r, trace)
        rows.append(row)
        by_name[setup.name] = setup
    elapsed = time.perf_counter() - t0
    ok = [r for r in rows if "error" not in r]
    best = max((r for r in ok if not r["adaptive"]), key=lambda r: (r["goodput_rps"], -r["p99_ms"]))
    per_min = [sum(1 for a in trace.arrivals if plo <= a.at_ns < phi) for _, plo, phi in trace.phases]
    cap = AZURE_DEVICE.capacity_rps(32, sum(a.tokens for a in trace.arrivals) / len(trace.arrivals))
    minute_s = 60.0 / AZURE_COMPRESS
    log(f"\n== 3a. Azure LLM conversation trace, simulated [{SIM}] ==")
    log(f"trace: {trace.description}; {len(trace.arrivals)} requests in {trace.duration_s:.1f} s")
    log(f"load per original minute (compressed to {minute_s:g} s): {min(per_min) / minute_s:.0f}..{max(per_min) / minute_s:.0f} rps; "
        f"device [{SIM}]: 1 accelerator, {AZURE_DEVICE.base_ms:g} ms + {AZURE_DEVICE.per_item_ms:g} ms/item + "
        f"{AZURE_DEVICE.per_token_ms * 1000:g} µs/token: ~{cap:.0f} rps with full batches of 32 at the mean context length; "
        f"channels: standard (deadline 1 s, the setup under test), bulk (tokens > 8192; 8/500 ms, deadline 30 s)")
    trows = []
    for r in rows:
        if "error" in r:
            trows.append([r["setup"], "error", r["error"][:60], "", "", "", "", "", "", "", ""])
            continue
        std = r["channels"].get("standard", {})
        bulk = r["channels"].get("bulk", {})
        trows.append([r["setup"] + (" *" if r["adaptive"] else ""), f"{r['goodput_rps']:.1f}", f"{r['on_time']:.2%}",
                      fmt_ms(std.get("p99_success_ms") or math.inf), fmt_ms(std.get("p99_completed_ms", 0)),
                      fmt_ms(std.get("p50_ms", 0)), std.get("late", 0), std.get("expired", 0),
                      f"{bulk.get('on_time', 0)}/{bulk.get('offered', 0)}", f"{r['utilisation']:.0%}",
                      "best fixed" if r is best else ""])
    log(table(["setup", "goodput rps", "on-time", "std p99 ms", "std p99 done ms", "std p50 ms", "std late",
               "std expired", "bulk on-time", "util", ""], trows))
    log(f"({len(rows)} runs simulated in {elapsed:.2f} s; * adaptive)")
    return {"trace": trace.description, "requests": len(trace.arrivals), "device": AZURE_DEVICE.options(),
            "rows": rows, "best_fixed": best["setup"], "simulated": True, "elapsed_s": elapsed,
            "setups": {n: s for n, s in by_name.items()}}


# -- live replay ---------------------------------------------------------------

def _config_toml(tmp: Path, setup: Setup) -> str:
    return textwrap.dedent(f"""\
        [daemon]
        listen = "ipc://{tmp}/req.sock"
        control = "ipc://{tmp}/ctl.sock"
        drain_timeout_s = 10
        log_level = "warning"
        [devices]
        use = ["cpu"]
        inflight = 2
        [models.sim]
        runner = "simulated"
        options = {_toml_table(AZURE_DEVICE.options())}
        [channels.standard]
        deadline_ms = 1000
        queue_limit = 4096
        priority = 1
        """) + setup.toml() + textwrap.dedent("""
        [channels.bulk]
        max_batch = 8
        window_ms = 500
        deadline_ms = 30000
        queue_limit = 4096
        min_share = 0.05
        [routing]
        default = "standard"
        [[routing.rules]]
        tokens_above = 8192
        channel = "bulk"
        """)


def _daemon(tmp: Path, setup: Setup) -> Daemon:
    """The replay's daemon (the shared launcher of benchmarks/harness.py), not started yet."""
    return ipc_daemon(tmp, lambda endpoint, control: _config_toml(tmp, setup), name=f"dynbatchd ({setup.name})")


def _replay(endpoint: str, trace: traces.Trace, route, tail_s: float,
            lag_out: list[float] | None = None) -> list[tuple[str, str, float]]:
    """Send every arrival at its (compressed) time; latency from the scheduled time. -> (channel, outcome, ms).

    The benchmarks' one open-loop generator (`loadgen.send_open_loop`): sends never wait for
    replies, so a slow daemon cannot slow the offered load, and latency counts from the
    schedule, so a generator that falls behind makes latency worse, not better. How late each
    send went out is appended to `lag_out` (ms).
    """
    from dynbatchd.client import build_request

    arrivals = trace.arrivals
    offsets = np.array([a.at_ns / 1e9 for a in arrivals])
    headers = [build_request(i + 1, "sim", 0, tokens=a.tokens)[0] for i, a in enumerate(arrivals)]
    channels = [route(a) for a in arrivals]
    sent = loadgen.send_open_loop(endpoint, offsets, headers, drain_s=tail_s, start_delay_s=0.05)
    if lag_out is not None:
        lag_out.extend((sent.sent_lag * 1000.0).tolist())
    latency = sent.latency_ms()
    out = []
    for i, channel in enumerate(channels):
        code = sent.code(i)
        out.append((channel, "completed" if code == "ok" else code, float(latency[i]) if code != loadgen.MISSING
                    else math.inf))
    return out


def summarise_replay(results: list[tuple[str, str, float]], span_s: float, slo_ms: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for channel in sorted({c for c, _, _ in results}):
        sel = [(o, ms) for c, o, ms in results if c == channel]
        done = sorted(ms for o, ms in sel if o == "completed")
        on_time = sum(1 for ms in done if ms <= slo_ms[channel])
        rank = max(1, math.ceil(0.99 * len(sel)))
        codes: dict[str, int] = {}
        for o, _ in sel:
            codes[o] = codes.get(o, 0) + 1
        out[channel] = {"offered": len(sel), "outcomes": codes, "on_time": on_time,
                        "goodput_rps": goodput_rps(on_time, span_s), "on_time_fraction": on_time_fraction(on_time, len(sel)),
                        "p50_ms": done[len(done) // 2] if done else math.inf,
                        "p99_success_ms": done[rank - 1] if rank <= len(done) else math.inf}
    return out


def bench_azure_replay(reg: Registry, sim: dict[str, Any], quick: bool, log=print) -> dict[str, Any]:
    """Best fixed setting (chosen by the simulation) and every adaptive policy, through the real daemon."""
    from dynbatchd.simulate import rules_router

    trace = azure_trace(quick)
    setups: dict[str, Setup] = sim["setups"]
    # The best fixed setting, each adaptive window alone, each adaptive sizer with a fixed window.
    chosen = [setups[sim["best_fixed"]]] + [s for s in setups.values()
                                            if s.adaptive and (s.sizer == "static" or s.window == "fixed")]
    if quick:
        chosen = chosen[:4]
    route = rules_router(azure_channels(chosen[0]), AZURE_ROUTING)
    span_s = trace.duration_s
    slo_ms = {"standard": 1000.0, "bulk": 30000.0}
    sim_rows = {r["setup"]: r for r in sim["rows"] if "error" not in r}
    rows = []
    for setup in chosen:
        with tempfile.TemporaryDirectory(prefix="dynbatchd-replay-") as tmpdir:
            tmp = Path(tmpdir)
            t0 = time.perf_counter()
            lags: list[float] = []
            with _daemon(tmp, setup).start(60.0) as daemon:
                load_before = os.getloadavg()[0]
                results = _replay(daemon.endpoint, trace, route, tail_s=15.0, lag_out=lags)
                status = daemon.status()
            wall = time.perf_counter() - t0
        per = summarise_replay(results, span_s, slo_ms)
        on_time = sum(c["on_time"] for c in per.values())
        lags.sort()
        rows.append({"setup": setup.name, "adaptive": setup.adaptive, "channels": per,
                     "goodput_rps": goodput_rps(on_time, span_s), "wall_s": wall,
                     "send_lag_p99_ms": lags[int(0.99 * (len(lags) - 1))] if lags else 0.0,
                     "loadavg_before": load_before, "loadavg_after": os.getloadavg()[0],
                     "daemon": {n: {k: v for k, v in c.items() if k in ("mean_batch", "p99_ms", "completed", "expired",
                                                                         "window")}
                                for n, c in status.get("channels", {}).items()},
                     "sim": sim_rows.get(setup.name)})
    log(f"\n== 3b. Azure trace replayed through the live daemon (dynbatchd start, runner \"simulated\") [{SIM} device] ==")
    log(f"trace: {trace.description}; {len(trace.arrivals)} requests in {span_s:.1f} s; latency measured by the client "
        f"from each request's scheduled send time")
    trows = []
    for r in rows:
        std, bulk = r["channels"].get("standard", {}), r["channels"].get("bulk", {})
        simr = r["sim"] or {}
        sstd = simr.get("channels", {}).get("standard", {})
        trows.append([r["setup"] + (" *" if r["adaptive"] else " (best fixed in sim)"),
                      f"{r['goodput_rps']:.1f}", f"{simr.get('goodput_rps', float('nan')):.1f}",
                      f"{std.get('on_time_fraction', 0):.2%}", fmt_ms(std.get("p99_success_ms", math.inf)),
                      fmt_ms(sstd.get("p99_success_ms") or math.inf), fmt_ms(std.get("p50_ms", math.inf)),
                      f"{bulk.get('on_time', 0)}/{bulk.get('offered', 0)}", fmt_ms(bulk.get("p99_success_ms", math.inf)),
                      " ".join(f"{k}:{v}" for k, v in sorted(std.get("outcomes", {}).items()) if k != "completed"),
                      f"{r['daemon'].get('standard', {}).get('mean_batch', 0):.1f}",
                      f"{r['send_lag_p99_ms']:.1f}", f"{r['loadavg_before']:.1f}"])
    log(table(["setup", "goodput live", "goodput sim", "std on-time", "std p99 live", "std p99 sim", "std p50 live",
               "bulk on-time", "bulk p99", "std errors", "mean batch", "send lag p99 ms", "load avg"], trows))
    log("(load avg: 1-minute load of this machine when the run began; the live figures share the CPUs with "
        "whatever else runs, the simulated ones do not)")
    return {"trace": trace.description, "rows": rows, "simulated_device": True}


# ---------------------------------------------------------------------------

def _clean(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items() if not isinstance(v, Setup)}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, Setup):
        return obj.name
    return obj


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.adaptive", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter traces, same shape")
    parser.add_argument("--replay", action="store_true", help="also replay the Azure trace through the live daemon")
    parser.add_argument("--only", default="phased,k12,azure", help="comma list of: phased, k12, azure")
    parser.add_argument("--json", default=str(RESULTS / "adaptive.json"), help="where to write the figures")
    args = parser.parse_args(argv)
    only = {x.strip() for x in args.only.split(",")}
    command = "python -m benchmarks.adaptive " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    print(f"command: {command.strip()}")
    print(f"All device figures below come from the simulated accelerator: {SIM}.")
    reg = Registry.load()
    print(f"registered window policies: {', '.join(sorted(reg.windows))}; batch sizers: {', '.join(sorted(reg.sizers))}")
    doc: dict[str, Any] = {"command": command.strip(), "simulated": True,
                           "windows": sorted(reg.windows), "sizers": sorted(reg.sizers)}
    t0 = time.perf_counter()
    if "phased" in only:
        doc["phased"] = bench_phased(reg, args.quick)
        doc["phased_inflight1"] = bench_phased(reg, args.quick, inflight=1)
    if "k12" in only:
        doc["k12"] = bench_k12(reg, args.quick)
    if "azure" in only:
        sim = bench_azure_sim(reg, args.quick)
        if sim is not None:
            doc["azure_sim"] = sim
            if args.replay:
                doc["azure_replay"] = bench_azure_replay(reg, sim, args.quick)
            else:
                print("(live-daemon replay of the Azure trace: add --replay)")
    doc["elapsed_s"] = time.perf_counter() - t0
    print(f"\ntotal {doc['elapsed_s']:.1f} s; command: {command.strip()}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_clean(doc), indent=1))
        print(f"figures written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
