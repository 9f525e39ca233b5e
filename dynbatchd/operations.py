"""What operators ask of a running daemon: status, metrics, tune and reload, a canary, warmup,
stop and drain; and the records kept for them (the top-users sketch, the compliance audit).

A mixin of `dynbatchd.service.Daemon`, kept apart from the request path: the
control commands (`dynbatchd.control.commands`) and the metrics page call
these; none of them touches a socket.
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
from dynbatchd.devices.batches import Pending
from dynbatchd.devices.observer import gpu_readings
from dynbatchd.engine import Job
from dynbatchd.metrics import render as render_metrics
from dynbatchd.scheduler import build_channels
from dynbatchd.telemetry import daemon_health
from dynbatchd.topusers import FILE_NAME as TOP_USERS_FILE
from dynbatchd.validation import validate_config

log = logging.getLogger("dynbatchd")


class Operations:
    # -- the top-users sketch ---------------------------------------------------
    def top_users_path(self):
        return state_path(self.config.daemon, TOP_USERS_FILE)

    def save_top_users(self) -> None:
        """Write the top-users sketch to the state directory, if it counted anything since the
        last save (a daemon that sees no users writes nothing)."""
        sketch = self.top_users
        if sketch is None or sketch.observed == self._top_users_saved:
            return
        try:
            sketch.save(self.top_users_path())
            self._top_users_saved = sketch.observed
        except OSError as exc:
            log.error("could not save the top-users sketch in %s: %s", self.config.daemon.state_dir, exc.strerror)
        except Exception as exc:   # (never the daemon's exit code: the sketch is an optimisation)
            log.error("could not save the top-users sketch: %s", type(exc).__name__)

    async def _save_top_users_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.config.top_users.save_every_s)
            self.save_top_users()

    # -- warmup -------------------------------------------------------------
    def warmup(self, model: str | None, top_users: int) -> dict[str, Any]:
        """Queue the inputs the warmup plugins name; they run in the warmup channel as it has room.
        With nothing to queue, "reason" says why."""
        channel = self.config.cache.warmup_channel or self.config.routing.default
        self.save_top_users()   # the built-in plugin reads what was observed up to now
        queued = cached = 0
        for m in [model] if model else list(self.config.models):
            for spec in self.plugins.warmup_jobs(m, top_users, self.config):
                jobs = (Job(spec.model, channel, P.estimate_tokens(r), 0, Pending(None, r), spec.tenant,
                            (spec.model, spec.tenant, text))
                        for text in spec.inputs for r in (P.Request(0, spec.model, text=text, tenant=spec.tenant),))
                q, c = self.engine.add_warmup(jobs, channel)
                queued, cached = queued + q, cached + c
        self._schedule_pump()
        answer: dict[str, Any] = {"queued": queued, "already_cached": cached,
                                  "backlog": len(self.engine.warmup_backlog), "channel": channel}
        if not queued and not cached:
            answer["reason"] = self._nothing_to_warm()
        return answer

    def _nothing_to_warm(self) -> str:
        source = self.config.plugins.get("warmup", {}).get("source")
        if source:
            return f"the warmup source {source} named no input (missing, empty or malformed: see the daemon's log)"
        if self.top_users is None:
            return "the daemon observes no users ([top_users] users = 0) and [plugins.warmup] source is not set"
        if not len(self.top_users):
            return ("the daemon has observed no request with a user and a text input yet "
                    f"({self.top_users.observed} counted); clients set the request's \"user\" field")
        return "no warmup plugin named an input of these models for the top users"

    # -- stopping -------------------------------------------------------------
    def request_stop(self) -> None:
        """First SIGTERM drains (answer what was accepted), a second one stops at once."""
        if self.state == "draining":
            log.warning("second stop signal: answering the rest shutting_down and exiting")
            self._settled.set()
        self.state = "draining"
        systemd.notify("STOPPING=1")
        self._stop.set()

    async def _drain(self) -> None:
        engine, started = self.engine, self.clock()
        queued, running = engine.scheduler.depth(), sum(len(d.held) for d in engine.devices)
        log.info("draining: %d queued, %d batches in flight", queued, running)
        engine.drain()
        self._pump()
        timeout = self.config.daemon.drain_timeout_s
        try:
            await asyncio.wait_for(self._settled.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        leftovers = engine.stop(self.clock())   # from here on a late result answers nobody twice
        self._send(leftovers)
        took = (self.clock() - started) / 1e9
        if leftovers:
            log.warning("drain stopped after %.1f s: %d requests answered shutting_down", took, len(leftovers))
        else:
            log.info("drain finished in %.1f s: every accepted request answered", took)

    # -- compliance ---------------------------------------------------------------
    def _refuse(self, envelope, request_id, channel: str, tenant: str | None, rule: str, reason: str) -> None:
        self.engine.refused(channel)
        self.audit.record(rule, "refused", channel, tenant, request_id)
        self._reject(envelope, request_id, P.REFUSED, reason)

    def _on_isolation(self, rule: str, action: str, job: Job) -> None:
        request = job.payload.request if isinstance(job.payload, Pending) else None
        self.audit.record(rule, action, job.channel, job.tenant, request.id if request is not None else None)

    # -- control ------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now = self.clock()
        snap = self.engine.snapshot(now)
        gpus = gpu_readings()
        devices = [{**d, **(self.pool.describe(i) if self.pool else {}),
                    **({"gpu": dataclasses.asdict(gpus[d["device"]])} if d["device"] in gpus else {})}
                   for i, d in enumerate(snap["devices"])]
        deadlines = {name: c.settings.deadline_ms for name, c in self.engine.channels.items()}   # a twin's too
        return {
            "daemon": {"version": __version__, "pid": os.getpid(), "state": self.state,
                       "uptime_s": round((now - self.started_ns) / 1e9, 3), "config": self.config.source,
                       "listen": self.config.daemon.listen,
                       "bad_requests": self.front.bad_requests if self.front else 0,
                       "dropped": self.front.dropped if self.front else 0,
                       "replies_undelivered": self.front.io.undeliverable if self.front else 0,
                       "unauthenticated": sum(p.unauthenticated for p in (self.front, self.control) if p is not None),
                       "quarantined": snap["quarantined"],
                       "health": daemon_health(snap["channels"], deadlines, devices, self.engine.memory_used)},
            "channels": snap["channels"],
            "devices": devices,
            "cache": {**self.cache.snapshot(), "warmup_backlog": snap["warmup_backlog"]} if self.cache is not None else None,
            "compliance": self.audit.snapshot(),
            "canary": self.canary_report(),
        }

    # -- canary -------------------------------------------------------------
    def start_canary(self, channel: str, changes: dict[str, Any], share: float, seconds: float,
                     shadow: bool) -> dict[str, Any]:
        """Run `changes` on `share` of `channel`'s live traffic (copies of it with `shadow`) in a twin
        channel for `seconds`; the engine's judge then promotes them or rolls back (`_canary_ended`).
        The candidate is checked by the same rules and compliance plugins as a config file."""
        from dynbatchd.tuning.canary import CANARY_SUFFIX, Canary   # the tuning package only when asked

        candidate = cfgmod.with_channel(self.config, channel, **changes)
        validate_config(candidate, self.plugins)
        twin = channel + CANARY_SUFFIX
        built = build_channels({twin: candidate.channels[channel]}, self.plugins.window_policies(),
                               self.plugins.batch_sizers())[twin]
        judge = Canary(share, int(seconds * 1e9), self.clock(), shadow=shadow)
        self.engine.start_split(channel, built, judge, shadow=shadow)
        self.canary_changes[channel] = dict(changes)
        self.canary_ends.pop(channel, None)
        log.info("canary of channel %s started: %s on %.0f%% of its traffic%s for %.0f s", channel,
                 ", ".join(f"{k}={v}" for k, v in changes.items()), 100 * share, " (shadow copies)" if shadow else "",
                 seconds)
        self._schedule_pump()
        return self.canary_report()

    def stop_canary(self, channel: str) -> dict[str, Any]:
        """End a running canary now, as a rollback."""
        from dynbatchd.tuning.canary import ROLLBACK, Verdict

        split = self.engine.splits.get(channel)
        if split is None:
            raise KeyError(channel)
        self.engine.end_split(channel, Verdict(ROLLBACK, "stopped by the operator",
                                               split.judge.figures(self.clock())))
        return self.canary_report()

    def _canary_ended(self, split: Any) -> None:
        """The judge's verdict (or a stop): a promotion becomes the channel's setting, as a tune
        would make it (runtime only); a rollback leaves the incumbent as it runs."""
        verdict, changes = split.verdict, self.canary_changes.pop(split.channel, {})
        action = verdict.action
        if action == "promote":
            try:
                self.apply_config(cfgmod.with_channel(self.config, split.channel, **changes))
            except ConfigError as exc:   # the config changed under the canary (a reload): keep what runs
                action, verdict.reason = "rollback", f"promotion refused: {exc}"
        self.canary_ends[split.channel] = {"action": action, "reason": verdict.reason, "changes": changes,
                                           "shadow": split.shadow, **verdict.figures}
        log.info("canary of channel %s ended: %s: %s", split.channel, action, verdict.reason)

    def canary_report(self) -> dict[str, Any]:
        """The running canary (its figures so far) and how the last one of each channel ended."""
        now = self.clock()
        running = {name: {"twin": s.twin, "shadow": s.shadow, "changes": self.canary_changes.get(name, {}),
                          "duration_s": s.judge.duration_ns / 1e9, **s.judge.figures(now)}
                   for name, s in self.engine.splits.items()}
        return {"running": running, "ended": dict(self.canary_ends)}

    def metrics_page(self) -> str:
        return render_metrics(self.status(), {name: c.stats.latency.lifetime
                                              for name, c in self.engine.channels.items()})

    def apply_config(self, new: Config) -> list[str]:
        """Adopt a validated config: channel settings, policies and routing change in place,
        keeping what each channel learned unless its policy or the policy's options change.

        Returns the sections that cannot change without a restart (daemon,
        devices, models, cache); they keep running as they are and the rest is
        applied. Adding or removing a channel is refused outright.
        """
        validate_config(new, self.plugins)
        old = self.config
        if set(old.channels) != set(new.channels):
            raise ConfigError(new.source, "channels", "adding or removing channels needs a restart; "
                              "nothing was applied")
        needs_restart = [key for key in ("daemon", "devices", "models", "cache")
                         if cfgmod.to_dict(getattr(old, key)) != cfgmod.to_dict(getattr(new, key))]
        rebuilt = build_channels(new.channels, self.plugins.window_policies(), self.plugins.batch_sizers())
        for name, settings in new.channels.items():   # a canary's twin keeps the candidate's settings
            self.engine.channels[name].retune(settings, rebuilt[name])
        self.config = new if not needs_restart else msgspec.structs.replace(
            new, daemon=old.daemon, devices=old.devices, models=old.models, cache=old.cache)
        self._schedule_pump()
        return needs_restart

    def reload(self) -> list[str]:
        if not self.config_path:
            raise ConfigError(self.config.source, "", "daemon was started without a config file")
        systemd.notify("RELOADING=1")
        try:
            return self.apply_config(cfgmod.load(self.config_path))
        finally:
            systemd.notify("READY=1")

    def _reload_from_signal(self) -> None:
        try:
            pending = self.reload()
            log.info("configuration reloaded%s", f"; needs a restart to change: {', '.join(pending)}" if pending else "")
        except ConfigError as exc:
            log.error("reload refused, keeping the running configuration: %s", exc)
