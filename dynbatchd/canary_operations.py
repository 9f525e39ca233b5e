"""A canary: candidate settings on a share of one channel's live traffic, judged by the engine,
then promoted (as a tune, to the drop-in) or rolled back.

Composed, not mixed in: the daemon holds one `CanaryOperations` (``daemon.canary``); the canary
control command and the status page call it, and the daemon hands it each verdict the engine
returns (`ended`). It keeps what each running canary tries, who started it and how each channel's
last one ended; the rest (config, engine, plugins, the tune's commit) it reads from the daemon.
"""

from __future__ import annotations

import logging
from typing import Any

from dynbatchd import config as cfgmod
from dynbatchd.config import ConfigError
from dynbatchd.operations import RiskRefused, _settings_text
from dynbatchd.scheduler import build_channels
from dynbatchd.validation import validate_config

log = logging.getLogger("dynbatchd")


class CanaryOperations:
    """The daemon's canaries (see the module docstring)."""

    def __init__(self, daemon: Any):
        self.daemon = daemon
        self.canary_changes: dict[str, dict[str, Any]] = {}   # channel -> what its running canary tries
        self.canary_ends: dict[str, dict[str, Any]] = {}      # channel -> how its last canary ended
        self.canary_by: dict[str, dict[str, Any]] = {}        # channel -> who started its canary, its risk

    async def start_checked(self, channel: str, changes: dict[str, Any], share: float, seconds: float,
                                   shadow: bool, *, by: str = "local", force: bool = False) -> dict[str, Any]:
        """`start` after the risk assessment, which refuses a risky candidate unless `force`."""
        self.daemon.operations.check_channel_still_there(channel)
        validate_config(cfgmod.with_channel(self.daemon.config, channel, **changes), self.daemon.plugins)   # before any assessment
        verdict = (await self.daemon.operations.assess({channel: changes}))[channel]
        if not verdict.accepted and not force:
            log.warning("canary of channel %s by %s refused: risk %s (force to run it anyway)", channel, by,
                        verdict.verdict())
            raise RiskRefused(verdict.reason, {"channel": channel, "risk": verdict.as_dict()})
        self.daemon.operations.check_channel_still_there(channel)   # the assessment takes a while too
        who = {"by": by, "risk": verdict.verdict(), "forced": force and not verdict.accepted}
        return self.start(channel, changes, share, seconds, shadow, who=who)

    def start(self, channel: str, changes: dict[str, Any], share: float, seconds: float,
                     shadow: bool, who: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run `changes` on `share` of `channel`'s live traffic (copies of it with `shadow`) in a twin
        channel for `seconds`; the engine's judge then promotes them or rolls back (`ended`).
        The candidate is checked by the same rules and compliance plugins as a config file.
        `who` (who started it, the risk verdict, forced) is recorded once the canary runs: a start
        refused as already running once overwrote the running canary's record."""
        from dynbatchd.tuning.canary import CANARY_SUFFIX, Canary   # the tuning package only when asked

        candidate = cfgmod.with_channel(self.daemon.config, channel, **changes)
        validate_config(candidate, self.daemon.plugins)
        twin = channel + CANARY_SUFFIX
        built = build_channels({twin: candidate.channels[channel]}, self.daemon.plugins.window_policies(),
                               self.daemon.plugins.batch_sizers())[twin]
        judge = Canary(share, int(seconds * 1e9), self.daemon.clock(), shadow=shadow)
        self.daemon.engine.start_split(channel, built, judge, shadow=shadow)
        self.canary_changes[channel] = dict(changes)
        self.canary_ends.pop(channel, None)
        who = self.canary_by[channel] = who or {"by": "local", "risk": "not assessed", "forced": False}
        log.info("canary of channel %s started by %s: %s on %.0f%% of its traffic%s for %.0f s (risk %s%s)", channel,
                 who["by"], _settings_text(changes), 100 * share, " (shadow copies)" if shadow else "", seconds,
                 who["risk"], "; forced" if who["forced"] else "")
        self.daemon._schedule_pump()
        return self.report()

    def stop(self, channel: str, why: str = "stopped by the operator") -> dict[str, Any]:
        """End a running canary now, as a rollback; `why`: the verdict's reason (a reload that
        removes its channel says so)."""
        from dynbatchd.tuning.canary import ROLLBACK, Verdict

        split = self.daemon.engine.splits_running().get(channel)
        if split is None:
            raise KeyError(channel)
        self.daemon.engine.end_split(channel, Verdict(ROLLBACK, why,
                                               split.judge.figures(self.daemon.clock())))
        self.daemon.operations.carry_out(self.daemon.engine.take_events())
        return self.report()

    def ended(self, split: Any) -> None:
        """The judge's verdict (or a stop): a promotion becomes the channel's setting as a tune
        makes it (written to the drop-in); a rollback leaves the incumbent as it runs."""
        verdict, changes = split.verdict, self.canary_changes.pop(split.channel, {})
        who = self.canary_by.pop(split.channel, {"by": "local", "risk": "not assessed", "forced": False})
        action = verdict.action
        if action == "promote":
            try:
                running = cfgmod.to_dict(self.daemon.config.channels[split.channel])
                self.daemon.operations.commit(split.channel, {k: running.get(k) for k in changes}, changes,
                                              source="canary", by=who["by"], why=f"canary promoted: {verdict.reason}",
                                              risk=who["risk"], forced=who["forced"])
            except (ConfigError, OSError) as exc:   # the config changed under the canary, or the disk: keep what runs
                action, verdict.reason = "rollback", f"promotion refused: {exc}"
        self.canary_ends[split.channel] = {"action": action, "reason": verdict.reason, "changes": changes,
                                           "shadow": split.shadow, **verdict.figures}
        log.info("canary of channel %s ended: %s: %s", split.channel, action, verdict.reason)

    def report(self) -> dict[str, Any]:
        """The running canary (its figures so far) and how the last one of each channel ended."""
        now = self.daemon.clock()
        running = {name: {"twin": s.twin, "shadow": s.shadow, "changes": self.canary_changes.get(name, {}),
                          "duration_s": s.judge.duration_ns / 1e9, **s.judge.figures(now)}
                   for name, s in self.daemon.engine.splits_running().items()}
        return {"running": running, "ended": dict(self.canary_ends)}
