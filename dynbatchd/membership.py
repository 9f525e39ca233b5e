"""What a reload changes in the set of models and channels, applied live.

Composed, not mixed in: the daemon holds one `Membership` (``daemon.membership``), which keeps
the models loading, unloading and held by the workers, and reads the daemon's config, engine,
pool and plugins when called. `dynbatchd.operations.Operations` asks it what a reload adds,
removes and needs a restart for; the daemon's scheduling pass and worker events tell it when
a model has loaded or drained.

A channel added is routable at once; one removed takes no new request and is dropped from the
engine, status and metrics once every request it holds is answered (`Engine.retire_channel`). A
model added is refused unknown_model until a worker has loaded it (`loading_models`); one removed
is refused at once, stays loaded until nothing of it is queued or running (`unloading_models`),
then leaves the workers. Models load by a message to the running workers (`DevicePool.set_models`),
so no process and no batch in flight is touched; a pool without that (Ray) needs a restart.

A model that no worker could load leaves `loading_models` for `failed_models`, with the reason,
shown by status and logged once; it is refused unknown_model saying so. It has failed once every
serving worker answered the current model set (its latest Setup: `Worker.unanswered` is 0; a Ready
to an earlier one says nothing of this one) without it; the Ready's `failed` says why. It is then
no longer asked of the workers (one restarting would fail at its start on it); the next reload
that changes the models tries it again.
"""

from __future__ import annotations

import logging
from typing import Any

from dynbatchd import config as cfgmod, protocol as P
from dynbatchd.config import Config
from dynbatchd.memory import device_limits
from dynbatchd.telemetry import NvmlProbe

log = logging.getLogger("dynbatchd")


def model_specs(config: Config) -> dict[str, P.ModelSpec]:
    """What the workers are told to load for each model of `config`."""
    return {n: P.ModelSpec(n, m.runner, dict(m.options)) for n, m in config.models.items()}


class Membership:
    """The daemon's models as a reload changes them (see the module docstring)."""

    def __init__(self, daemon: Any, config: Config):
        self.daemon = daemon
        self.loading_models: set[str] = set()     # added by a reload, not loaded on any worker yet
        self.unloading_models: set[str] = set()   # removed by a reload, still holding accepted requests
        self.failed_models: dict[str, str] = {}   # added by a reload, loaded by no worker: the reason
        self._lacking: dict[str, set[int]] = {}   # model loading -> workers that said Ready without it
        self.model_specs = model_specs(config)    # what the workers hold, by model

    def models_need_restart(self, old: Config, new: Config) -> bool:
        """Models can change live only on a pool that loads them live (not Ray), and only by being
        added or removed: a model kept under the same name with other settings needs a restart."""
        if old.models == new.models:
            return False
        pool = self.daemon.pool
        if pool is not None and not hasattr(pool, "set_models"):
            return True
        return any(cfgmod.to_dict(old.models[n]) != cfgmod.to_dict(new.models[n])
                   for n in set(old.models) & set(new.models))

    @staticmethod
    def added_removed(old: Config, new: Config) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
        """(added, removed): the channels and models `new` adds to and removes from `old`."""
        added = {k: sorted(set(getattr(new, k)) - set(getattr(old, k))) for k in ("channels", "models")}
        removed = {k: sorted(set(getattr(old, k)) - set(getattr(new, k))) for k in ("channels", "models")}
        return added, removed

    def change_models(self, old: Config, new: Config) -> None:
        """Ask the workers to load the models added (refused unknown_model until one has) and keep
        the removed ones loaded until their accepted requests are answered (`unload_drained_models`)."""
        d = self.daemon
        retried = set(self.failed_models)   # the workers are sent the whole set again: they try these anew
        self.loading_models = (self.loading_models | retried | (set(new.models) - set(old.models))) & set(new.models)
        self.failed_models, self._lacking = {}, {}
        self.unloading_models = (self.unloading_models | (set(old.models) - set(new.models))) - set(new.models)
        self.model_specs = {**self.model_specs, **model_specs(new)}
        self._forget_answers(set(new.models) - set(old.models))   # a name reused: its old answers are not the new model's
        answers = getattr(d, "tenant_answers", None)   # /metrics labels a model it knows by name
        if answers is not None and answers.models is not None:
            answers.models |= set(new.models)
        d.engine.set_device_limits(device_limits(new, d.devices, d.plugins.runners(), NvmlProbe()))   # per device again
        if d.pool is not None:
            d.pool.set_models(self._held(new))
            self.models_loaded()

    def _held(self, config: Config) -> list[P.ModelSpec]:
        """What the workers are asked to hold: `config`'s models but those that failed to load (a
        worker that restarts would fail on them at its start), and those still unloading."""
        names = [n for n in config.models if n not in self.failed_models]
        return [self.model_specs[n] for n in [*names, *sorted(self.unloading_models)]]

    def models_loaded(self, worker: int | None = None) -> None:
        """The added models some worker has loaded now serve (one log line each); `worker`: the one
        that just said Ready, whose Ready without a model counts towards that model's failure."""
        pool = self.daemon.pool
        loaded = {m for m in self.loading_models if pool is None or pool.loaded(m)}
        for model in sorted(loaded):
            log.info("model %s loaded: serving it", model)
        self.loading_models = self.loading_models - loaded
        if worker is not None and self.loading_models and pool is not None:
            self._note_lacking(pool, worker)

    def _note_lacking(self, pool: Any, index: int) -> None:
        """Worker `index` said Ready without some models loading: once every serving worker has, those
        models failed. A Ready to an older model set (the pool sends the current one next) says nothing."""
        workers = getattr(pool, "workers", None)
        if not workers or tuple(workers[index].asked) != tuple(m.name for m in pool.models) \
                or getattr(workers[index], "unanswered", 0):   # (a Setup after the one it answered is on its way)
            return
        for model in self.loading_models - set(workers[index].models):
            self._lacking.setdefault(model, set()).add(index)
        serving = {w.index for w in workers if w.state == "ready"}
        failed = sorted(m for m in self.loading_models if serving and serving <= self._lacking.get(m, set()))
        for model in failed:
            reasons = sorted({w.load_failures[model] for w in workers if model in getattr(w, "load_failures", {})})
            self._failed(model, len(serving), "; ".join(reasons))
        if failed:   # no longer asked of the workers: a worker that restarts would fail on them
            pool.set_models(self._held(self.daemon.config))

    def _failed(self, model: str, workers: int, error: str = "") -> None:
        reason = (f"no worker could load it ({workers} said ready without it): {error}" if error else
                  f"no worker could load it ({workers} said ready without it); the worker's log gives the error")
        log.error("model %s failed to load after the reload: %s", model, reason)
        self.loading_models = self.loading_models - {model}
        self._lacking.pop(model, None)
        self.failed_models[model] = reason

    def unready(self, model: str) -> str | None:
        """Why the intake refuses `model` though the config names it (loading, or failed), or None."""
        if model in self.loading_models:
            return f"model {model!r} is still loading"
        reason = self.failed_models.get(model)
        return None if reason is None else f"model {model!r} failed to load: {reason}"

    def _forget_answers(self, models: set[str]) -> None:
        """Drop the result cache's answers of `models` (keys `intake.cache_key_of`: the model first).
        A model removed, then added again under its name with other code, answered the old model's
        cached results until they aged out."""
        cache = getattr(self.daemon, "cache", None)
        if cache is not None and models:
            cache.discard_if(lambda key: key[0] in models)

    def unload_drained_models(self) -> None:
        """Removed models with nothing of them queued or running any more leave the workers."""
        d = self.daemon
        generating = {run.pending.request.model for run in d.generation.jobs.values()}   # (not the engine's)
        drained = {m for m in self.unloading_models if not d.engine.holds_model(m) and m not in generating}
        if not drained:
            return
        self.unloading_models = self.unloading_models - drained
        self.model_specs = {n: spec for n, spec in self.model_specs.items() if n not in drained}
        self._forget_answers(drained)
        if d.pool is not None:
            d.pool.set_models(self._held(d.config))
        log.info("model %s unloaded: every request accepted for it was answered", ", ".join(sorted(drained)))
