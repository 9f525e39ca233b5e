"""Recommender: an SLO-constrained search over max_batch x window x window policy for one channel.

Each trial replays the channel's traffic (the analyzer's model) through the daemon's engine on
the simulator and is scored by on-time throughput; a trial whose on-time share falls below the
target is infeasible. optuna's TPE sampler picks the trials; the incumbent is always trial 0, so
the answer is never worse than keeping what runs. Where the incumbent meets the target, a trial
whose p99 is more than 5% longer is infeasible too: the canary would roll it back. Every figure
is SIMULATED."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import msgspec

from dynbatchd import config as cfgmod
from dynbatchd.config import ConfigError, PolicySettings
from dynbatchd.simulate import SimResult
from dynbatchd.tuning.analyzer import ChannelModel
from dynbatchd.validation import validate_config

BATCHES = (1, 2, 4, 8, 16, 32, 64)
WINDOWS_MS = (0.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0)
POLICIES = ("fixed", "slo")
TARGET_ON_TIME = 0.99
P99_MARGIN = 0.05     # how much longer a p99 may get and still count as no worse (the canary's rule too)


@dataclass(frozen=True, slots=True)
class Setting:
    max_batch: int
    window_ms: float
    policy: str = "fixed"

    def as_dict(self) -> dict[str, Any]:
        return {"max_batch": self.max_batch, "window_ms": self.window_ms, "policy": self.policy}

    @classmethod
    def of(cls, channel: cfgmod.ChannelSettings) -> "Setting":
        return cls(channel.max_batch, channel.window_ms, channel.window.policy if channel.window else "fixed")


@dataclass(frozen=True, slots=True)
class Score:
    on_time: float           # the channel's on-time share
    goodput_rps: float       # on-time throughput
    p99_ms: float
    device_s: float          # device time its batches took

    def as_dict(self) -> dict[str, Any]:
        return {"on_time": round(self.on_time, 5), "goodput_rps": round(self.goodput_rps, 3),
                "p99_ms": round(self.p99_ms, 2), "device_s": round(self.device_s, 3), "simulated": True}


def apply(cfg: cfgmod.Config, channel: str, s: Setting) -> cfgmod.Config:
    """`cfg` with the channel at setting `s`, checked as a config file (compliance included) by the caller."""
    current = cfg.channels[channel]
    window = None if s.policy == "fixed" and current.window is None else (
        current.window if current.window and current.window.policy == s.policy else PolicySettings(policy=s.policy))
    new = msgspec.structs.replace(current, max_batch=s.max_batch, window_ms=s.window_ms, window=window)
    return msgspec.structs.replace(cfg, channels={**cfg.channels, channel: new})


def score(result: SimResult, channel: str) -> Score:
    mine = result.stats("channel").get(channel)
    device = sum(r.compute_ns for r in result.batches if r.channel == channel) / 1e9
    if mine is None:
        return Score(1.0, 0.0, 0.0, device)
    return Score(mine.on_time_fraction, mine.goodput_rps, mine.p99_ms, device)


def better(a: Score, b: Score) -> bool:
    """More on-time throughput (beyond 0.1%), else as much for less device time, else a lower p99."""
    if abs(a.goodput_rps - b.goodput_rps) > 1e-3 * max(b.goodput_rps, 1e-9):
        return a.goodput_rps > b.goodput_rps
    if abs(a.device_s - b.device_s) > 0.02 * max(b.device_s, 1e-9):
        return a.device_s < b.device_s
    return a.p99_ms < 0.95 * b.p99_ms


class Evaluator:
    """Scores settings on the model, each at most once (a trial repeated by the sampler is free)."""

    def __init__(self, cfg: cfgmod.Config, model: ChannelModel, plugins: Any, sim_kw: dict[str, Any] | None = None):
        self.cfg, self.model, self.plugins = cfg, model, plugins
        self.arrivals = model.traffic()
        self.kw = {"window_policies": plugins.window_policies(), "sizers": plugins.batch_sizers(),
                   "inflight": cfg.devices.inflight, "queue_lead_ms": cfg.devices.queue_lead_ms, **(sim_kw or {})}
        self.seen: dict[Setting, Score | None] = {}

    def config_for(self, s: Setting) -> cfgmod.Config:
        """The config with `s`; ConfigError when a config file could not say it (e.g. the banking limit)."""
        new = apply(self.cfg, self.model.channel, s)
        validate_config(new, self.plugins)
        return new

    def __call__(self, s: Setting) -> Score | None:
        if s not in self.seen:
            try:
                channels = self.config_for(s).channels
            except ConfigError:
                self.seen[s] = None
                return None
            self.seen[s] = score(self.model.run({self.model.channel: channels[self.model.channel]},
                                                self.arrivals, **self.kw), self.model.channel)
        return self.seen[s]


def search(evaluate: Evaluator, trials: int = 30, seed: int = 1, target: float = TARGET_ON_TIME,
           on_trial: Callable[[Setting, Score | None], None] | None = None) -> tuple[Setting, Score, Setting, Score]:
    """(best setting, its score, the incumbent, its score). The best is feasible (on time >= target)
    or, when nothing is, the one with the most on time."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    deadline = evaluate.cfg.channels[evaluate.model.channel].deadline_ms
    windows = [w for w in WINDOWS_MS if w < deadline]
    incumbent = Setting.of(evaluate.cfg.channels[evaluate.model.channel])
    policies = [p for p in POLICIES if p in evaluate.plugins.window_policies()]
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    best: tuple[Setting, Score] | None = None
    now = evaluate(incumbent)
    # As the canary judges: where the incumbent meets the target, a candidate may not lengthen its p99.
    p99_cap = now.p99_ms * (1 + P99_MARGIN) if now is not None and now.on_time >= target else float("inf")

    def feasible(a: Score) -> bool:
        return a.on_time >= target and a.p99_ms <= p99_cap

    def prefer(a: Score, b: Score) -> bool:
        """Feasible over infeasible; among feasible, `better`; among infeasible, more on time."""
        fa, fb = feasible(a), feasible(b)
        if fa != fb:
            return fa
        return better(a, b) if fa else a.on_time > b.on_time

    def objective(trial: Any) -> float:
        nonlocal best
        s = Setting(trial.suggest_categorical("max_batch", list(BATCHES)),
                    trial.suggest_categorical("window_ms", windows),
                    trial.suggest_categorical("policy", policies))
        sc = evaluate(s)
        if on_trial:
            on_trial(s, sc)
        if sc is None:
            return -1.0
        if best is None or prefer(sc, best[1]):
            best = (s, sc)
        return sc.goodput_rps if feasible(sc) else sc.on_time - 1.0

    if incumbent.max_batch in BATCHES and incumbent.window_ms in windows and incumbent.policy in policies:
        study.enqueue_trial(incumbent.as_dict())
    study.optimize(objective, n_trials=trials)
    if now is not None and (best is None or not prefer(best[1], now)):
        best = (incumbent, now)
    assert best is not None, "no trial was feasible under the config's rules"
    return best[0], best[1], incumbent, now if now is not None else best[1]
