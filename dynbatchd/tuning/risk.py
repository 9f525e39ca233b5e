"""Risk: would a candidate keep the channel's SLO on recent traffic and on bursts of it?

The candidate and the incumbent are replayed (SIMULATED) on the recent traffic and on the same
traffic scaled x1.5 and x2. The candidate is refused, with the reason, when a config file could
not say it (the compliance plugin's rules, e.g. banking_max_window_ms), when it misses the target
on-time share on recent traffic, when its p99 there is more than 5% longer than the
incumbent's (where the incumbent meets the target), or when on any burst it keeps more than `threshold` fewer
requests on time than the incumbent would (a burst the incumbent cannot carry either is no
reason to refuse).

`assess` judges a `Setting` the loop found; `assess_change` judges any change of a channel's
settings (a manual tune, a canary, a reload, `check-config --risk`) on what the daemon observed:
one assessment for every path. Too little traffic to fit a model is no evidence of risk: such a
change is accepted, marked `assessed: false`, and the reason says so."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dynbatchd import config as cfgmod
from dynbatchd.config import ConfigError
from dynbatchd.tuning import analyzer, collector
from dynbatchd.tuning.recommender import P99_MARGIN, TARGET_ON_TIME, Evaluator, Score, Setting, score

SCALES = (1.0, 1.5, 2.0)
THRESHOLD = 0.02     # on-time share a candidate may lose to the incumbent on a burst
DURATION_S = 3.0     # seconds of the channel's traffic replayed when the daemon assesses a change


@dataclass(slots=True)
class Assessment:
    candidate: Setting
    accepted: bool
    reason: str
    predicted: dict[str, dict[str, Any]] = field(default_factory=dict)   # "x1.5" -> {candidate, incumbent}
    assessed: bool = True   # False: too little traffic to judge (accepted, and the reason says so)

    def as_dict(self) -> dict[str, Any]:
        return {"candidate": self.candidate.as_dict(), "accepted": self.accepted, "reason": self.reason,
                "predicted": self.predicted, "assessed": self.assessed, "simulated": True}

    def verdict(self) -> str:
        """One line for a log, a status or the drop-in file."""
        word = "accepted" if self.accepted else "refused"
        return f"{word}: {self.reason}" if self.assessed else self.reason


def assess(evaluate: Evaluator, candidate: Setting, *, target: float = TARGET_ON_TIME,
           threshold: float = THRESHOLD, scales: tuple[float, ...] = SCALES) -> Assessment:
    """Predicted on-time share and p99 of `candidate` beside the incumbent, and the verdict."""
    try:
        candidate_cfg = evaluate.config_for(candidate)
    except ConfigError as exc:
        return Assessment(candidate, False, f"refused by the config rules: {exc.key}: {exc.rule}")
    return _judge(evaluate, candidate, candidate_cfg.channels[evaluate.model.channel], target, threshold, scales)


def assess_change(cfg: cfgmod.Config, status: dict[str, Any], channel: str, changes: dict[str, Any],
                  plugins: Any, *, duration_s: float = DURATION_S, target: float = TARGET_ON_TIME,
                  threshold: float = THRESHOLD, seed: int = 1) -> Assessment:
    """The risk of changing `channel` of the running `cfg` by `changes`, on the traffic a daemon's
    `status` shows (the collector's rules: too little of it and the change is not assessed)."""
    from dynbatchd.validation import validate_config

    try:
        candidate_cfg = cfgmod.with_channel(cfg, channel, **changes)
        validate_config(candidate_cfg, plugins)
    except ConfigError as exc:
        return Assessment(Setting.of(cfg.channels[channel]), False, f"refused by the config rules: {exc.key}: {exc.rule}")
    new = candidate_cfg.channels[channel]
    try:
        observation = collector.collect(status, channel)
    except collector.NotEnoughData as exc:
        return Assessment(Setting.of(new), True, f"not assessed: {exc}", assessed=False)
    evaluate = Evaluator(cfg, analyzer.fit(observation, duration_s, seed), plugins)
    return _judge(evaluate, Setting.of(new), new, target, threshold, SCALES)


def _judge(evaluate: Evaluator, candidate: Setting, settings: cfgmod.ChannelSettings, target: float,
           threshold: float, scales: tuple[float, ...]) -> Assessment:
    model, channel = evaluate.model, evaluate.model.channel
    runs: dict[str, tuple[Score, Score]] = {}
    for scale in scales:
        arrivals = model.traffic(scale)
        mine = score(model.run({channel: settings}, arrivals, **evaluate.kw), channel)
        theirs = score(model.run({channel: evaluate.cfg.channels[channel]}, arrivals, **evaluate.kw), channel)
        runs[f"x{scale:g}"] = (mine, theirs)
    predicted = {k: {"candidate": m.as_dict(), "incumbent": t.as_dict()} for k, (m, t) in runs.items()}
    recent, _ = runs["x1"]
    if recent.on_time < target:
        return Assessment(candidate, False, f"predicted on-time share {100 * recent.on_time:.2f}% on recent "
                          f"traffic is below the target {100 * target:.2f}%", predicted)
    _, now = runs["x1"]
    if now.on_time >= target and recent.p99_ms > now.p99_ms * (1 + P99_MARGIN):
        return Assessment(candidate, False, f"predicted p99 {recent.p99_ms:.1f} ms on recent traffic against the "
                          f"incumbent's {now.p99_ms:.1f} ms (more than {100 * P99_MARGIN:g}% longer)", predicted)
    for key, (mine, theirs) in runs.items():
        if theirs.on_time - mine.on_time > threshold:
            return Assessment(candidate, False, f"at {key} traffic the predicted on-time share is "
                              f"{100 * mine.on_time:.2f}% against the incumbent's {100 * theirs.on_time:.2f}% "
                              f"(more than {100 * threshold:g} points worse)", predicted)
    return Assessment(candidate, True, "predicted within the SLO on recent traffic and no worse than the "
                      f"incumbent by more than {100 * threshold:g} points at " + ", ".join(runs), predicted)
