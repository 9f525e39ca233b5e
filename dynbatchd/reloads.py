"""Reloads: the config file read again and run with the tuning drop-in on top, risk-assessed,
one at a time.

Composed, not mixed in: `dynbatchd.operations.Operations` holds one `Reloads` (``reloads``) and
hands it the control command's and SIGHUP's reloads; it reads and writes the tuning state (the
file's config, the drop-in) on that `Operations`, and the rest from the daemon. Reloads take
turns, each planned on what the last one left: two planned at once once applied in the order
their assessments ended, an older file last, and a tune that landed during an assessment was
undone by it. A SIGHUP that arrives while an earlier one's reload waits for its turn joins it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from dynbatchd import config as cfgmod, systemd
from dynbatchd.config import Config, ConfigError
from dynbatchd.errors import DynbatchdError
from dynbatchd.overrides import Overrides
from dynbatchd.validation import validate_config

log = logging.getLogger("dynbatchd")

REPLANS = 5   # a reload plans again at most this often while tunes land during its risk assessment


class RiskRefused(DynbatchdError):
    """A change the risk assessment refused (and nobody forced); `plan` is what it would have done."""

    def __init__(self, reason: str, plan: dict[str, Any]):
        super().__init__(reason)
        self.plan = plan


class Reloads:
    """The daemon's reloads (see the module docstring)."""

    def __init__(self, daemon: Any, ops: Any):
        self.daemon, self.ops = daemon, ops   # ops: the `Operations` whose tuning state a reload replaces
        self._reload_turn = asyncio.Lock()    # reloads apply one at a time, each planned on the last one
        self._signal_reload_waiting = False   # a SIGHUP's reload waits for its turn (later SIGHUPs join it)
        self._running: set[asyncio.Task] = set()   # SIGHUP reloads under way (the loop keeps only weak refs)

    async def reload(self, *, by: str = "local", force: bool = False, dry_run: bool = False,
                     config: Config | None = None) -> dict[str, Any]:
        """Re-read the config file (or check `config` with `dry_run`) and run it with the drop-in on
        top: a key the file changed drops its override (the file wins). Each channel it changes is
        risk-assessed; a risky reload is refused unless `force`. Logs exactly one line, whatever the
        outcome, plus one naming the overrides the file took over. Reloads take turns: two planned
        at once applied in the order their assessments ended, an older file last."""
        if dry_run:
            return await self._reload_now(by=by, force=force, dry_run=True, config=config)
        async with self._reload_turn:
            return await self._reload_now(by=by, force=force, config=config)

    async def _reload_now(self, *, by: str, force: bool = False, dry_run: bool = False,
                          config: Config | None = None) -> dict[str, Any]:
        word = "checked" if dry_run else "reloaded"
        if not dry_run:
            systemd.notify("RELOADING=1")
        try:
            plan, new_file, overrides, effective = await self._plan_on_current_tuning(config)
            refused = {ch: v["reason"] for ch, v in plan["risk"].items() if not v["accepted"]}
            if dry_run:
                log.info("configuration checked by %s (dry run): %s", by, self._reload_text(plan, refused))
                return plan
            if refused and not force:
                raise RiskRefused("; ".join(f"channel {ch}: {why}" for ch, why in refused.items()), plan)
            if plan["dropped_overrides"]:
                overrides.save()
            plan["needs_restart"] = self.ops.apply_config(effective)
            self.ops.file_config, self.ops.overrides = new_file, overrides
        except ConfigError as exc:
            if dry_run:   # a check (check-config --risk): nothing was to be reloaded, nothing is wrong with the daemon
                log.info("configuration checked by %s (dry run): refused: %s", by, exc)
            else:
                log.error("reload refused, keeping the running configuration: %s", exc)
            raise
        except RiskRefused as exc:
            log.warning("reload by %s refused, keeping the running configuration: risk refused %s "
                        "(dynbatchctl reload --force applies it anyway)", by, exc)
            raise
        except OSError as exc:
            log.error("reload refused, keeping the running configuration: tuning drop-in: %s", exc)
            raise ConfigError(str(overrides.path), "", f"cannot write: {exc.strerror or exc}") from None
        finally:
            if not dry_run:
                systemd.notify("READY=1")
        plan["applied"] = True
        log.info("configuration %s by %s: %s%s", word, by, self._reload_text(plan, refused),
                 "; FORCED past the risk assessment" if refused else "")
        if plan["dropped_overrides"]:
            log.info("tuning overrides dropped (the config file changed them, removed their channel, or they "
                     "no longer fit it): %s", ", ".join(plan["dropped_overrides"]))
        return plan

    async def _plan_on_current_tuning(self, config: Config | None) -> tuple[dict[str, Any], Config, Overrides, Config]:
        """`_plan_reload`, planned again while the tuning changed during its risk assessment: a tune,
        rollback, canary promotion or other reload that landed meanwhile would otherwise be undone
        by this reload's older copy of the drop-in (acknowledged, yet gone from the running config
        while still in the file)."""
        for _ in range(REPLANS):
            basis = self.ops.overrides
            planned = await self._plan_reload(config)
            if self.ops.overrides is basis:
                return planned
        raise ConfigError(self.daemon.config.source, "",
                          f"the tuning changed {REPLANS} times while this reload was planned; try again")

    async def _plan_reload(self, config: Config | None) -> tuple[dict[str, Any], Config, Overrides, Config]:
        if config is None:
            if not self.daemon.config_path:
                raise ConfigError(self.daemon.config.source, "", "daemon was started without a config file")
            config = cfgmod.load(self.daemon.config_path)
        validate_config(config, self.daemon.plugins)
        overrides = self.ops.overrides.copy()
        dropped = overrides.reconcile(self.ops.file_config, config)
        try:
            effective = overrides.apply(config)
            validate_config(effective, self.daemon.plugins)
        except ConfigError as exc:   # an override no longer fits the new file (e.g. a shorter deadline)
            channel = exc.key.split(".")[1] if exc.key.startswith("channels.") else None
            if channel is None:
                raise
            dropped += overrides.drop_channel(channel)
            effective = overrides.apply(config)
            validate_config(effective, self.daemon.plugins)
        needs_restart = self.ops.needs_restart(effective)
        self._check_kept_sections(effective, needs_restart)
        changes = {}
        for name, now in self.daemon.config.channels.items():
            if name not in effective.channels:
                continue   # removed: listed under "removed", nothing to assess
            old, new = cfgmod.to_dict(now), cfgmod.to_dict(effective.channels[name])
            changes[name] = {k: new[k] for k in new if new[k] != old[k]}
        verdicts = await self.ops.assess(changes)
        added, removed = self.daemon.membership.added_removed(self.daemon.config, effective)
        if "models" in needs_restart:
            added["models"], removed["models"] = [], []
        plan = {"needs_restart": needs_restart, "dropped_overrides": dropped, "applied": False,
                "added": added, "removed": removed,
                "changes": {ch: {k: [cfgmod.to_dict(self.daemon.config.channels[ch])[k], v] for k, v in c.items()}
                            for ch, c in changes.items() if c},
                "risk": {ch: v.as_dict() for ch, v in verdicts.items()}}
        return plan, config, overrides, effective

    def _check_kept_sections(self, new: Config, kept: list[str]) -> None:
        """`new` as it would run, with the sections only a restart changes kept as they run, checked
        as a config file: a reload that removed the channel the kept ``[cache] warmup_channel`` names
        left the engine feeding warmup into a channel that no longer exists (the pump raised at every
        step and no request was answered). ConfigError naming the key."""
        if not kept:
            return
        running = msgspec.structs.replace(new, **{key: getattr(self.daemon.config, key) for key in kept})
        try:
            cfgmod.check_references(running)
            validate_config(running, self.daemon.plugins)
        except ConfigError as exc:
            tables = ", ".join(f"[{key}]" for key in kept)
            raise ConfigError(new.source, exc.key, f"{exc.rule}: the running {tables} stays until a restart, "
                                                   "and this file does not fit it") from None

    @staticmethod
    def _reload_text(plan: dict[str, Any], refused: dict[str, str]) -> str:
        changed = [f"channels.{ch}.{k} {a} -> {b}" for ch, c in plan["changes"].items() for k, (a, b) in c.items()]
        moved = [f"{word} {kind[:-1]} {name}" for word, key in (("added", "added"), ("removed", "removed"))
                 for kind, names in plan.get(key, {}).items() for name in names]
        text = ", ".join(moved + changed) or "no channel setting changed"
        if plan["needs_restart"]:
            text += f"; needs a restart to change: {', '.join(plan['needs_restart'])}"
        if refused:
            text += "; risk refused " + "; ".join(f"channel {ch}: {why}" for ch, why in refused.items())
        return text

    def from_signal(self) -> None:
        """SIGHUP: the reload runs as a task (its risk assessment takes a moment); it logs its line.
        A SIGHUP while an earlier one's reload still waits for its turn joins it: that reload reads
        the file as it is then (a storm of them was a storm of reloads, each logging its line)."""
        if self._signal_reload_waiting:
            return
        self._signal_reload_waiting = True

        async def run() -> None:
            async with self._reload_turn:
                self._signal_reload_waiting = False   # the file is read from here on: a later SIGHUP reloads again
                try:
                    await self._reload_now(by="SIGHUP")
                except (ConfigError, RiskRefused):
                    pass   # already logged, in one line
        task = asyncio.ensure_future(run())
        self._running.add(task)
        task.add_done_callback(self._running.discard)
