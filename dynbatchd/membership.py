"""What a reload changes in the set of models and channels, applied live (a mixin of
`dynbatchd.operations.Operations`, itself the daemon's).

A channel added is routable at once; one removed takes no new request and is dropped from the
engine, status and metrics once every request it holds is answered (`Engine.retire_channel`). A
model added is refused unknown_model until a worker has loaded it (`loading_models`); one removed
is refused at once, stays loaded until nothing of it is queued or running (`unloading_models`),
then leaves the workers. Models load by a message to the running workers (`DevicePool.set_models`),
so no process and no batch in flight is touched; a pool without that (Ray) needs a restart.
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
    loading_models: set[str] = frozenset()     # added by a reload, not loaded on any worker yet
    unloading_models: set[str] = frozenset()   # removed by a reload, still holding accepted requests
    model_specs: dict[str, Any] = {}           # what the workers hold, by model (set at start)
    plugins: Any                               # the daemon's Plugins: its runner classes size the devices

    def _models_need_restart(self, old: Config, new: Config) -> bool:
        """Models can change live only on a pool that loads them live (not Ray), and only by being
        added or removed: a model kept under the same name with other settings needs a restart."""
        if old.models == new.models:
            return False
        if self.pool is not None and not hasattr(self.pool, "set_models"):
            return True
        return any(cfgmod.to_dict(old.models[n]) != cfgmod.to_dict(new.models[n])
                   for n in set(old.models) & set(new.models))

    @staticmethod
    def _membership(old: Config, new: Config) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
        """(added, removed): the channels and models `new` adds to and removes from `old`."""
        added = {k: sorted(set(getattr(new, k)) - set(getattr(old, k))) for k in ("channels", "models")}
        removed = {k: sorted(set(getattr(old, k)) - set(getattr(new, k))) for k in ("channels", "models")}
        return added, removed

    def _change_models(self, old: Config, new: Config) -> None:
        """Ask the workers to load the models added (refused unknown_model until one has) and keep
        the removed ones loaded until their accepted requests are answered (`_unload_drained_models`)."""
        self.loading_models = (set(self.loading_models) | (set(new.models) - set(old.models))) & set(new.models)
        self.unloading_models = (set(self.unloading_models) | (set(old.models) - set(new.models))) - set(new.models)
        self.model_specs = {**self.model_specs, **model_specs(new)}
        answers = getattr(self, "tenant_answers", None)   # /metrics labels a model it knows by name
        if answers is not None and answers.models is not None:
            answers.models |= set(new.models)
        self.engine.set_device_limits(device_limits(new, self.devices, self.plugins.runners(), NvmlProbe()))   # per device again
        if self.pool is not None:
            self.pool.set_models([self.model_specs[n] for n in [*new.models, *sorted(self.unloading_models)]])
            self._models_loaded()

    def _models_loaded(self) -> None:
        """The added models some worker has loaded now serve (one log line each)."""
        loaded = {m for m in self.loading_models if self.pool is None or self.pool.loaded(m)}
        for model in sorted(loaded):
            log.info("model %s loaded: serving it", model)
        self.loading_models = self.loading_models - loaded

    def _unload_drained_models(self) -> None:
        """Removed models with nothing of them queued or running any more leave the workers."""
        drained = {m for m in self.unloading_models if not self.engine.holds_model(m)}
        if not drained:
            return
        self.unloading_models = self.unloading_models - drained
        self.model_specs = {n: spec for n, spec in self.model_specs.items() if n not in drained}
        if self.pool is not None:
            self.pool.set_models([self.model_specs[n] for n in [*self.config.models, *sorted(self.unloading_models)]])
        log.info("model %s unloaded: every request accepted for it was answered", ", ".join(sorted(drained)))

