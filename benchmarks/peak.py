"""The guide's two peak cases, on the simulated device through the daemon's engine (SIMULATED).

    python -m benchmarks.scenarios sales-peak     # the e-commerce sales peak; about 20 s
    python -m benchmarks.scenarios k12            # the K12 evening surge on etc/dynbatchd.toml

**sales-peak.** A recommendation channel at 3x its normal load: 60% session refreshes from a hot
set of daily users (each asks for its own recommendations again and again), 40% new sessions of
one-off rare users (never asked again). The result cache holds a little more than the hot set.
Three setups on the same arrivals: the untagged LRU baseline (every result kept, the least
recently used out, the daemon before this work), frequency admission alone (W-TinyLFU, no
tags), and lifecycle tags with frequency admission (the built-in `lifecycle` policy: refreshes
kept, a rare user's one-off kept only if asked again). Printed: cache hit rate, device busy
share, p99 of the refresh requests (refused or expired ones count as slower than any answer).

**k12.** The shipped configuration's three channels under the K12 evening surge: an hour of
normal traffic, then +300% for an hour; 95% short requests, 5% essays of 10k+ tokens. Printed:
realtime on-time share, each channel's on-time share and the device's busy share, per phase.
"""

from __future__ import annotations

import math
import random
import subprocess
from pathlib import Path

from dynbatchd.cache import ResultCache
from dynbatchd.config import ChannelSettings, load as load_config, table_of
from dynbatchd.plugins import Plugins
from dynbatchd.simulate import Arrival, DeviceModel, simulate
from dynbatchd.simulate.results import COMPLETED, quantile

REPO = Path(__file__).resolve().parent.parent
MS = 1_000_000
DEVICE = DeviceModel(base_ms=8.0, per_item_ms=0.5, per_token_ms=0.002)
BATCH = 32
HOT_USERS, CACHE_ENTRIES = 2_000, 2_200
CAPACITY_RPS = BATCH / ((DEVICE.base_ms + DEVICE.per_item_ms * BATCH + DEVICE.per_token_ms * 64 * BATCH) / 1000)


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip() or "unknown"


# -- sales peak ------------------------------------------------------------------

def sales_peak_arrivals(seconds: float = 60.0, hot_users: int = HOT_USERS, normal_share: float = 0.5,
                        peak: float = 3.0, refresh_share: float = 0.5, seed: int = 11) -> list[Arrival]:
    """Poisson arrivals at `peak` x the normal rate (`normal_share` of the device's capacity)."""
    rng = random.Random(seed)
    rate = peak * normal_share * CAPACITY_RPS
    out, t, one_off = [], 0.0, 0
    while t < seconds:
        t += rng.expovariate(rate)
        if rng.random() < refresh_share:
            user = f"daily-{rng.randrange(hot_users)}"
            out.append(Arrival(int(t * 1e9), 64, request_type="session_refresh", user_frequency="daily",
                               text=f"recommendations for {user}", label="refresh"))
        else:
            one_off += 1
            out.append(Arrival(int(t * 1e9), 64, request_type="new_session", user_frequency="rare",
                               text=f"recommendations for one-off {one_off}", label="new session"))
    return out


def p99_ms(result, indices: list[int]) -> float:
    """p99 latency of `indices`; a request refused or expired counts as slower than any answer."""
    values = sorted(result.latency_ns[i] / MS if result.outcome[i] == COMPLETED else math.inf for i in indices)
    return quantile(values, 0.99) if values else math.nan


def sales_peak(seconds: float = 60.0, cache_entries: int = CACHE_ENTRIES) -> list[dict]:
    arrivals = sales_peak_arrivals(seconds)
    channel = {"recommend": ChannelSettings(max_batch=BATCH, window_ms=10, deadline_ms=5_000, queue_limit=100_000)}
    plugins = Plugins.load()
    policies = plugins.cache_policies()
    shipped = load_config_defaults()   # each policy reads its keys of [cache] from the config
    setups = [("untagged LRU (before)", policies["lru"](shipped), False),
              ("frequency admission, untagged", None, False),
              ("lifecycle tags + frequency admission", policies["lifecycle"](shipped), True)]
    steady = int(seconds / 2 * 1e9)   # the second half: every setup's cache has warmed up
    refresh = [i for i, a in enumerate(arrivals) if a.label == "refresh" and a.at_ns >= steady]
    rows = []
    for name, rule, tagged in setups:
        cache = ResultCache(cache_entries)
        trace = arrivals if tagged else [untag(a) for a in arrivals]
        r = simulate(channel, trace, device=DEVICE, window_policies=plugins.window_policies(),
                     cache=cache, cache_rule=rule)
        snap = cache.snapshot()
        rows.append({"setup": name, "hit_rate": snap["hit_rate"], "busy": r.utilisation(),
                     "refresh_p99_ms": p99_ms(r, refresh),
                     "refresh_p99_answered_ms": p99_ms(r, [i for i in refresh if r.outcome[i] == COMPLETED]),
                     "refresh_unanswered": sum(r.outcome[i] != COMPLETED for i in refresh),
                     "on_time": r.total().on_time_fraction,
                     "admissions_refused": snap["admissions_refused"], "evictions": snap["evictions"]})
    return rows


def untag(a: Arrival) -> Arrival:
    """The same request as a client that sends no lifecycle tags."""
    return Arrival(a.at_ns, a.tokens, text=a.text, label=a.label)


def load_config_defaults():
    return load_config(REPO / "etc" / "dynbatchd.toml")


def print_sales_peak(seconds: float) -> None:
    arrivals = sales_peak_arrivals(seconds)
    print(f"commit {commit()}; SIMULATED device {DEVICE.base_ms} ms + {DEVICE.per_item_ms} ms/item + "
          f"{DEVICE.per_token_ms} ms/token (64-token requests: {CAPACITY_RPS:,.0f} req/s at batch {BATCH}); "
          f"{len(arrivals):,} requests in {seconds:g} s = 3 x normal (normal: 50% of capacity); "
          f"50% session refreshes of {HOT_USERS:,} daily users (uniformly), 50% new sessions of one-off rare "
          f"users; cache {CACHE_ENTRIES:,} entries; channel max_batch 32, window 10 ms, deadline 5 s; "
          "refresh p99 over the second half (caches warm)\n")
    print("| setup | cache hit rate | device busy | refresh p99 | refresh p99 of those answered | "
          "refreshes refused or expired | on time (all) | admissions refused |")
    print("|---|---|---|---|---|---|---|---|")
    for row in sales_peak(seconds):
        p99 = row["refresh_p99_ms"]
        print(f"| {row['setup']} | {row['hit_rate']:.1%} | {row['busy']:.1%} | "
              f"{'not answered' if math.isinf(p99) else f'{p99:,.0f} ms'} | {row['refresh_p99_answered_ms']:,.0f} ms | "
              f"{row['refresh_unanswered']:,} | {row['on_time']:.1%} | "
              f"{row['admissions_refused']:,} |")


# -- K12 evening surge -------------------------------------------------------------

def k12_arrivals(normal_rps: float, hour_s: float, seed: int = 12) -> list[Arrival]:
    """An hour at `normal_rps`, then an hour at 4x (+300%); 95% short, 5% essays of 10k-16k tokens;
    5% of the short ones tagged urgent (the realtime channel)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while t < 2 * hour_s:
        rate = normal_rps * (4.0 if t >= hour_s else 1.0)
        t += rng.expovariate(rate)
        if rng.random() < 0.05:
            out.append(Arrival(int(t * 1e9), rng.randrange(10_000, 16_000), label="essay"))
        else:
            tags = ("urgent",) if rng.random() < 0.05 else ()
            out.append(Arrival(int(t * 1e9), rng.randrange(20, 400), tags=tags))
    return out


def k12(normal_share: float = 0.2, hour_s: float = 60.0) -> list[dict]:
    """Phases of the surge on the shipped config; one hour of the guide is `hour_s` simulated seconds."""
    config = load_config_defaults()
    plugins = Plugins.load()
    mean_cost_ms = 0.95 * (DEVICE.per_item_ms + DEVICE.per_token_ms * 210) + 0.05 * (
        DEVICE.per_item_ms + DEVICE.per_token_ms * 13_000)
    normal = normal_share * 1000 / (mean_cost_ms + DEVICE.base_ms / 16)
    arrivals = k12_arrivals(normal, hour_s)
    r = simulate(config.channels, arrivals, device=DEVICE, routing=table_of(config, "routing"), plugins=plugins,
                 window_policies=plugins.window_policies(), sizers=plugins.batch_sizers())
    rows = []
    for phase, start, end in (("normal hour", 0, hour_s), ("surge hour (+300%)", hour_s, 2 * hour_s)):
        s, e = int(start * 1e9), int(end * 1e9)
        per = r.stats(by="channel", start_ns=s, end_ns=e)
        rows.append({"phase": phase, "offered_rps": sum(g.offered for g in per.values()) / (end - start),
                     "busy": r.utilisation(s, e),
                     "channels": {name: {"on_time": g.on_time_fraction, "offered": g.offered,
                                         "completed": g.completed} for name, g in per.items()}})
    return rows


def print_k12(hour_s: float) -> None:
    print(f"commit {commit()}; SIMULATED device {DEVICE.base_ms} ms + {DEVICE.per_item_ms} ms/item + "
          f"{DEVICE.per_token_ms} ms/token; config etc/dynbatchd.toml (realtime / standard / bulk); "
          f"one guide hour = {hour_s:g} simulated s; normal load 20% of the device, surge 4x; "
          "95% short (20-400 tokens, 5% of them urgent), 5% essays of 10k-16k tokens\n")
    print("| phase | offered | device busy | realtime on time | standard on time | bulk completed |")
    print("|---|---|---|---|---|---|")
    for row in k12(hour_s=hour_s):
        ch = row["channels"]
        bulk = ch.get("bulk", {"completed": 0, "offered": 0})
        print(f"| {row['phase']} | {row['offered_rps']:,.0f} req/s | {row['busy']:.1%} | "
              f"{ch.get('realtime', {}).get('on_time', math.nan):.2%} | "
              f"{ch.get('standard', {}).get('on_time', math.nan):.2%} | {bulk['completed']:,} of {bulk['offered']:,} |")
