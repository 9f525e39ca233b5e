"""The operator commands that fill and empty the result cache: the top-users sketch (kept,
saved, loaded), warmup and erasure (``forget``).

Composed, not mixed in: the daemon holds one `CacheOperations` (``daemon.cache_ops``) and the
control commands call it; it reads the daemon's config, cache, engine, plugins, audit log and
sketch when called, so a reload's config is the one it sees. Warmup inputs are keyed with the
intake's `cache_key_of`, so a warmed input is the one a request with that text finds.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from dynbatchd import protocol as P
from dynbatchd.config import Config, state_path
from dynbatchd.daemon_batches import Pending
from dynbatchd.engine import Job
from dynbatchd.engine.intake import cache_key_of
from dynbatchd.operations import _settings_text
from dynbatchd.pseudonyms import FILE_NAME as PSEUDONYMS_FILE, Pseudonyms
from dynbatchd.topusers import FILE_NAME as TOP_USERS_FILE, TopUsers

log = logging.getLogger("dynbatchd")


class CacheOperations:
    """The sketch, warmup and erasure of one daemon (see the module docstring)."""

    def __init__(self, daemon: Any):
        self.daemon = daemon
        self._save_failure: str | None = None   # the error the last save of the sketch logged (None: it saved)

    # -- the top-users sketch ---------------------------------------------------
    def top_users_path(self):
        return state_path(self.daemon.config.daemon, TOP_USERS_FILE)

    def load_top_users(self, config: Config) -> TopUsers | None:
        """The sketch saved in the state directory, users kept as keyed hashes, texts only where
        the result cache is on (the only place warmup can use them); None with ``users = 0``."""
        settings = config.top_users
        if not settings.users:
            return None
        options = {"pseudonym": self._pseudonyms(config), "retain_days": settings.retain_days,
                   "max_text_bytes": settings.max_text_bytes, "text_budget": settings.text_budget_bytes}
        texts = settings.inputs_per_user if self.daemon.cache is not None else 0
        try:
            path = self.top_users_path()
        except OSError:   # (logged by _pseudonyms) counted, never saved
            return TopUsers(settings.users, texts, **options)
        return TopUsers.load(path, settings.users, texts, **options)

    def _pseudonyms(self, config: Config) -> Pseudonyms:
        """The keyed hash of user ids, its key in the state directory (one of this run only if the
        directory is unavailable)."""
        try:
            return Pseudonyms.load(state_path(config.daemon, PSEUDONYMS_FILE))
        except OSError as exc:
            log.error("state directory %s unavailable (%s): user ids are hashed with a key of this run only",
                      config.daemon.state_dir, exc.strerror)
            return Pseudonyms.load(None)

    def save_top_users(self) -> None:
        """Write the top-users sketch to the state directory, if it counted anything since the
        last save (a daemon that sees no users writes nothing)."""
        sketch = self.daemon.top_users
        if sketch is None or sketch.observed == self.daemon._top_users_saved:
            return
        try:
            sketch.save(self.top_users_path())
        except OSError as exc:
            self._save_failed(f"could not save the top-users sketch in {self.daemon.config.daemon.state_dir}: "
                              f"{exc.strerror or type(exc).__name__}")
        except Exception as exc:   # (never the daemon's exit code: the sketch is an optimisation)
            self._save_failed(f"could not save the top-users sketch: {type(exc).__name__}")
        else:
            self.daemon._top_users_saved = sketch.observed
            if self._save_failure is not None:
                log.info("top-users sketch saved again")
                self._save_failure = None

    def _save_failed(self, message: str) -> None:
        """One error line per cause: a save that keeps failing the same way (a directory in the file's
        place) is not logged again at every save interval and every warmup."""
        if message != self._save_failure:
            log.error("%s (not logged again while it fails so)", message)
        self._save_failure = message

    async def save_top_users_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.daemon.config.top_users.save_every_s)
            self.save_top_users()

    # -- erasure -------------------------------------------------------------
    def forget(self, user: str, tenant: Any = None, *, by: str = "local") -> dict[str, Any]:
        """Erase `user` (of every tenant, or of `tenant`) from the top-users sketch and its saved
        file (rewritten at once), and the inputs the sketch kept for them from the result cache
        and the warmup backlog (a warmup input already queued or running is not kept). Answers
        counts only; the audit log and the daemon's log name the user by its keyed hash."""
        sketch = self.daemon.top_users
        if sketch is None:   # nothing kept; the audit still names the user by its keyed hash
            key, erased = self._pseudonyms(self.daemon.config)(user), {}
        else:
            key, erased = sketch.forget(user, None if tenant is None else (tenant,))
        cache_keys = {(model, t, text) for t, inputs in erased.items() for model, text in inputs}
        counts = {"sketch_users": len(erased), "sketch_inputs": len(cache_keys),
                  "cache_entries": sum(self.daemon.cache.discard(k) for k in cache_keys) if self.daemon.cache is not None else 0,
                  "warmup_inputs": self.daemon.engine.forget_warmup(cache_keys) if cache_keys else 0}
        saved = True
        if erased:
            try:
                sketch.save(self.top_users_path())
                self.daemon._top_users_saved = sketch.observed
            except OSError as exc:
                saved = False
                log.error("forget: could not rewrite the top-users sketch in %s: %s", self.daemon.config.daemon.state_dir,
                          exc.strerror)
        self.daemon.audit.erasure(key, tenant, by, counts)
        log.info("forget by %s: user %s%s: %s", by, key[:16], f" of tenant {tenant}" if tenant is not None else "",
                 _settings_text(counts))
        return {**counts, "file_rewritten": bool(erased) and saved}

    # -- warmup -------------------------------------------------------------
    def warmup(self, model: str | None, top_users: int) -> dict[str, Any]:
        """Queue the inputs the warmup plugins name; they run in the warmup channel as it has room.
        With nothing to queue, "reason" says why."""
        channel = self.daemon.config.cache.warmup_channel or self.daemon.config.routing.default
        self.save_top_users()   # the built-in plugin reads what was observed up to now
        queued = cached = 0
        models, skipped = self._models_to_warm(model)
        for m in models:
            for spec in self.daemon.plugins.warmup_jobs(m, top_users, self.daemon.config):
                jobs = (Job(spec.model, channel, P.estimate_tokens(r), 0, Pending(None, r), spec.tenant,
                            cache_key_of(spec.model, spec.tenant, text))
                        for text in spec.inputs for r in (P.Request(0, spec.model, text=text, tenant=spec.tenant),))
                q, c = self.daemon.engine.add_warmup(jobs, channel)
                queued, cached = queued + q, cached + c
        self.daemon._schedule_pump()
        answer: dict[str, Any] = {"queued": queued, "already_cached": cached,
                                  "backlog": self.daemon.engine.warmup_waiting(), "channel": channel}
        if skipped:
            answer["skipped"] = skipped
        if not queued and not cached:
            answer["reason"] = self._nothing_to_warm(skipped if not models else None)
        return answer

    def _models_to_warm(self, model: str | None) -> tuple[list[str], dict[str, str]]:
        """(the models to warm, {model: why not} of those left out). Without `model`: every model of
        the config but those that failed to load or still load, whose inputs would run to no effect
        and be counted as warmed. (A `model` named is checked by the control command.)"""
        if model:
            return [model], {}
        unready = {m: self.daemon.membership.unready(m) for m in self.daemon.config.models}
        return [m for m, why in unready.items() if not why], {m: why for m, why in unready.items() if why}

    def _nothing_to_warm(self, every_model_skipped: dict[str, str] | None = None) -> str:
        if every_model_skipped:
            return "no model is ready: " + "; ".join(every_model_skipped.values())
        source = self.daemon.config.plugins.get("warmup", {}).get("source")
        if source:
            return f"the warmup source {source} named no input (missing, empty or malformed: see the daemon's log)"
        if self.daemon.top_users is None:
            return "the daemon observes no users ([top_users] users = 0) and [plugins.warmup] source is not set"
        if not len(self.daemon.top_users):
            return ("the daemon has observed no request with a user and a text input yet "
                    f"({self.daemon.top_users.observed} counted); clients set the request's \"user\" field")
        return "no warmup plugin named an input of these models for the top users"
