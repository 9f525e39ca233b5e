"""What operators ask of a running daemon: status, metrics, tune and reload, stop and drain; and
the records kept for them (the compliance audit, the tuning drop-in of `dynbatchd.overrides`).
Warmup, erasure and the top-users sketch are `dynbatchd.cache_operations`, a canary
`dynbatchd.canary_operations`, a reload `dynbatchd.reloads` (the models it adds and removes
`dynbatchd.membership`).

Every change of a channel's settings (a tune, a canary, a reload) passes the one risk assessment
of `dynbatchd.tuning.risk.assess_change`, run off the event loop, and is refused when risky
unless forced; each tune, reload and canary verdict logs exactly one line.

Composed, not mixed in: the daemon holds one `Operations` (``daemon.operations``), as it holds
its canaries and cache operations, kept apart from the request path; the control commands
(`dynbatchd.control.commands`), the signals and the metrics page call it. It keeps the tuning
state (the file's config, the drop-in) and reads the rest from the daemon when called, so a
reload's config is the one it sees; none of it touches a socket.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any

import msgspec

from dynbatchd import __version__, config as cfgmod, protocol as P, systemd
from dynbatchd.config import Config, ConfigError, state_path
from dynbatchd.daemon_batches import Pending
from dynbatchd.observer import gpu_readings
from dynbatchd.engine import AuditEvent, EngineEvent, Job
from dynbatchd.metrics import render as render_metrics
from dynbatchd.overrides import FILE_NAME as OVERRIDES_FILE, Overrides
from dynbatchd.reloads import Reloads, RiskRefused
from dynbatchd.scheduler import build_channels
from dynbatchd.telemetry import daemon_health
from dynbatchd.validation import validate_config

log = logging.getLogger("dynbatchd")


def _settings_text(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


class Operations:
    """The daemon's operator commands and their records (see the module docstring)."""

    def __init__(self, daemon: Any):
        self.daemon = daemon
        self.file_config: Config | None = None   # the config file as read, before the drop-in (`init_tuning`)
        self.overrides = Overrides(None)         # the tuning drop-in
        self.reloads = Reloads(daemon, self)     # reloads, one at a time (`dynbatchd.reloads`)

    # -- stopping -------------------------------------------------------------
    def request_stop(self) -> None:
        """First SIGTERM drains (answer what was accepted), a second one stops at once."""
        d = self.daemon
        if d.state == "draining":
            log.warning("second stop signal: answering the rest shutting_down and exiting")
            d._settled.set()
        d.state = "draining"
        systemd.notify("STOPPING=1")
        d._stop.set()

    async def drain(self) -> None:
        d = self.daemon
        engine, started = d.engine, d.clock()
        queued, running = engine.queued(), engine.batches_in_flight()
        log.info("draining: %d queued, %d batches in flight", queued, running)
        engine.drain()
        d._pump()
        timeout = d.config.daemon.drain_timeout_s
        try:
            await asyncio.wait_for(d._settled.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        leftovers = engine.stop(d.clock())   # from here on a late result answers nobody twice
        self.carry_out(engine.take_events())
        d._send(leftovers)
        took = (d.clock() - started) / 1e9
        if leftovers:
            log.warning("drain stopped after %.1f s: %d requests answered shutting_down", took, len(leftovers))
        else:
            log.info("drain finished in %.1f s: every accepted request answered", took)

    # -- compliance ---------------------------------------------------------------
    def refuse(self, envelope, request: P.Request, channel: str, tenant: str | None, rule: str,
               reason: str) -> None:
        """A compliance refusal: counted, audited, answered."""
        d = self.daemon
        d.engine.refused(channel)
        d.audit.record(rule, "refused", channel, tenant, request.id)
        d._reject(envelope, request, P.REFUSED, reason, channel)

    def _on_isolation(self, rule: str, action: str, job: Job) -> None:
        request = job.payload.request if isinstance(job.payload, Pending) else None
        self.daemon.audit.record(rule, action, job.channel, job.tenant, request.id if request is not None else None)

    def carry_out(self, events: list[EngineEvent]) -> None:
        """What the engine decided beside its answers (an audit record, a canary's verdict), done
        once its call has returned: never while it is part-way through a batch."""
        for event in events:
            if isinstance(event, AuditEvent):
                self._on_isolation(event.rule, event.action, event.job)
            else:
                self.daemon.canary.ended(event.split)

    # -- control ------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The daemon, channels, models, devices, cache, compliance, canary, overrides; each tenant's
        quotas and answers per tenant and model (the busiest by name); the generations."""
        d = self.daemon
        now = d.clock()
        snap = d.engine.snapshot(now)
        gpus = gpu_readings()
        devices = [{**dev, **(d.pool.describe(i) if d.pool else {}),
                    **({"gpu": dataclasses.asdict(gpus[dev["device"]])} if dev["device"] in gpus else {})}
                   for i, dev in enumerate(snap["devices"])]
        front, members = d.front, d.membership
        return {
            "daemon": {"version": __version__, "pid": os.getpid(), "state": d.state,
                       "uptime_s": round((now - d.started_ns) / 1e9, 3), "config": d.config.source,
                       "listen": d.config.daemon.listen,
                       "bad_requests": front.bad_requests if front else 0,
                       "dropped": front.dropped if front else 0,
                       "replies_undelivered": front.io.undeliverable if front else 0,
                       "unauthenticated": sum(p.unauthenticated for p in (front, d.control) if p is not None),
                       "quarantined": snap["quarantined"], "scheduling": snap["scheduling"],
                       "health": daemon_health(snap["channels"], snap["deadlines_ms"], devices, snap["memory_used"])},
            "channels": snap["channels"],
            "models": {"serving": sorted(set(d.config.models) - members.loading_models - set(members.failed_models)),
                       "loading": sorted(members.loading_models), "unloading": sorted(members.unloading_models),
                       "failed": dict(sorted(members.failed_models.items()))},
            "devices": devices,
            "cache": {**d.cache.snapshot(), "warmup_backlog": snap["warmup_backlog"]} if d.cache is not None else None,
            "compliance": d.audit.snapshot(),
            "canary": d.canary.report(),
            "overrides": self.overrides.describe(),
            "quotas": d.quotas.snapshot(), "tenants": d.tenant_answers.snapshot(),
            "generation": d.generation.snapshot(),
        }

    def metrics_page(self) -> str:
        return render_metrics(self.status(), self.daemon.engine.latency_lifetimes())

    def apply_config(self, new: Config) -> list[str]:
        """Adopt a validated config: channel settings, policies and routing change in place,
        keeping what each channel learned unless its policy or the policy's options change. A
        channel added is routable at once; one removed takes nothing new and goes once what it
        holds is answered. A model added is served once a worker has loaded it (`loading_models`);
        one removed is refused at once and unloaded once nothing of it is queued or running.

        Returns the sections that cannot change without a restart (daemon, devices, cache, top_users,
        http; models on a Ray pool); they keep running as they are and the rest is applied.
        """
        d = self.daemon
        validate_config(new, d.plugins)
        old = d.config
        needs_restart = self.needs_restart(new)
        rebuilt = build_channels(new.channels, d.plugins.window_policies(), d.plugins.batch_sizers())
        for name in new.channels:   # kept ones retune in place; a canary's twin keeps the candidate's settings
            d.engine.add_channel(rebuilt[name])
        for name in set(old.channels) - set(new.channels):
            if name in d.engine.splits_running():
                d.canary.stop(name, "its channel was removed by a reload")
            d.engine.retire_channel(name)
        d.config = msgspec.structs.replace(new, **{key: getattr(old, key) for key in needs_restart})
        d.intake.config = d.config
        if "models" not in needs_restart and old.models != new.models:
            d.membership.change_models(old, d.config)
        d._schedule_pump()
        return needs_restart

    def needs_restart(self, new: Config) -> list[str]:
        """The sections `new` changes that only a restart applies (models, on a pool that cannot load live;
        the top-users sketch and the HTTP door, built at start)."""
        old = self.daemon.config
        keys = [key for key in ("daemon", "devices", "cache", "top_users", "http")
                if cfgmod.to_dict(getattr(old, key)) != cfgmod.to_dict(getattr(new, key))]
        return keys + (["models"] if self.daemon.membership.models_need_restart(old, new) else [])

    # -- tuning that persists: the drop-in, tune, rollback, reload ------------------------
    def init_tuning(self, config: Config) -> Config:
        """At start: `config` (the file) with the drop-in of earlier tunes applied, checked by the
        same rules as the file. A drop-in that no longer validates is refused with one log line
        naming the key, and ignored: the daemon starts on the file alone."""
        self.file_config = config
        try:
            path = state_path(config.daemon, OVERRIDES_FILE)
        except OSError as exc:
            log.error("tuning drop-in unavailable (state directory %s: %s): tunes will not persist",
                      config.daemon.state_dir, exc.strerror)
            self.overrides = Overrides(None)
            return config
        try:
            self.overrides = Overrides.load(path)
        except ConfigError as exc:
            log.error("tuning drop-in refused and ignored: %s", exc)
            self.overrides = Overrides(path)
            return config
        try:
            tuned = self.overrides.apply(config)
            validate_config(tuned, self.daemon.plugins)
        except ConfigError as exc:
            log.error("tuning drop-in refused and ignored: %s: %s: %s", path, exc.key, exc.rule)
            self.overrides.data.channels = {}   # its trail stays; the next tune rewrites the file
            return config
        if self.overrides.data.channels:
            log.info("tuning drop-in %s applied: %s", path, ", ".join(
                f"channels.{c}.{k}" for c, keys in self.overrides.data.channels.items() for k in keys))
        return tuned

    async def assess(self, changes: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The risk assessment of each channel's `changes` (`tuning.risk.assess_change`), on what
        this daemon observed; the simulations run in a thread, so requests keep flowing."""
        from dynbatchd.tuning import risk   # the simulator only when asked

        cfg, status, plugins = self.daemon.config, self.status(), self.daemon.plugins

        def run() -> dict[str, Any]:
            return {ch: risk.assess_change(cfg, status, ch, c, plugins) for ch, c in changes.items() if c}
        return await asyncio.get_running_loop().run_in_executor(None, run)

    def commit(self, channel: str, before: dict[str, Any], after: dict[str, Any], **trail: Any) -> None:
        """Record a change in the drop-in, write it, and run with it; nothing changes if either fails."""
        overrides = self.overrides.copy()
        overrides.record(channel, before, after, **trail)
        self._adopt(overrides)

    def _adopt(self, overrides: Overrides) -> None:
        new = overrides.apply(self.file_config)
        validate_config(new, self.daemon.plugins)
        if overrides.path is None:
            raise OSError(f"no state directory to keep the tuning drop-in in ({self.file_config.daemon.state_dir})")
        overrides.save()
        self.overrides = overrides
        self.apply_config(new)

    async def tune(self, channel: str, changes: dict[str, Any], *, by: str = "local", why: str = "",
                   force: bool = False, dry_run: bool = False) -> dict[str, Any]:
        """Change `channel`'s settings after the risk assessment (refused when risky unless `force`)
        and keep the change in the drop-in. `dry_run`: only say what would change and the verdict."""
        self.check_channel_still_there(channel)
        candidate = cfgmod.with_channel(self.daemon.config, channel, **changes)
        validate_config(candidate, self.daemon.plugins)   # before any assessment
        running = cfgmod.to_dict(self.daemon.config.channels[channel])
        wanted = cfgmod.to_dict(candidate.channels[channel])
        before, changes = {k: running.get(k) for k in changes}, {k: wanted.get(k) for k in changes}
        verdict = (await self.assess({channel: changes}))[channel]
        plan = {"channel": channel, "before": before, "after": dict(changes), "risk": verdict.as_dict(),
                "verdict": verdict.verdict(), "applied": False}
        if dry_run:
            return plan
        forced = force and not verdict.accepted
        if not verdict.accepted and not force:
            log.warning("tune of channel %s by %s refused: risk %s (force to apply it anyway)", channel, by,
                        verdict.verdict())
            raise RiskRefused(verdict.reason, plan)
        self.commit(channel, before, changes, by=by, why=why or "set by hand", risk=verdict.verdict(),
                     forced=forced, source="tune")
        log.info("tune of channel %s by %s: %s -> %s (risk %s%s)", channel, by, _settings_text(before),
                 _settings_text(changes), verdict.verdict(), "; FORCED" if forced else "")
        return {**plan, "applied": True, "forced": forced,
                "settings": cfgmod.to_dict(self.daemon.config.channels[channel])}

    def check_channel_still_there(self, channel: str) -> None:
        """ConfigError unless `channel` is in the running config: a command checked it when it came,
        but a reload (a SIGHUP's, say) may have removed it before the command's coroutine ran."""
        if channel not in self.daemon.config.channels:
            raise ConfigError(self.daemon.config.source, f"channels.{channel}",
                              "no such channel: a reload removed it while the command waited")

    def rollback(self, channel: str, *, by: str = "local") -> dict[str, Any]:
        """One step back: undo `channel`'s last change still in force (LookupError when none)."""
        overrides = self.overrides.copy()
        change = overrides.rollback(channel, self.file_config, by=by)
        if change is None:
            raise LookupError(channel)
        self._adopt(overrides)
        log.info("tune of channel %s by %s: rollback to %s (%s)", channel, by, _settings_text(change.after), change.why)
        return {"channel": channel, "before": change.before, "after": change.after, "applied": True,
                "settings": cfgmod.to_dict(self.daemon.config.channels[channel])}

    # -- reloads: `dynbatchd.reloads` -------------------------------------------------------
    async def reload(self, *, by: str = "local", force: bool = False, dry_run: bool = False,
                     config: Config | None = None) -> dict[str, Any]:
        """`Reloads.reload`: the config file (or `config`) run with the drop-in on top."""
        return await self.reloads.reload(by=by, force=force, dry_run=dry_run, config=config)

    def reload_from_signal(self) -> None:
        """`Reloads.from_signal`: SIGHUP."""
        self.reloads.from_signal()
