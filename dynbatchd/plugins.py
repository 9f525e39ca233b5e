"""The plugin manager: one typed method per hook, so call sites stay checked.

Built-in plugins and third-party ones load through the same entry-point group
(``dynbatchd``). A plugin that fails to import is reported and skipped; a
misspelt hook implementation fails loudly at start (``check_pending``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable

import pluggy

from dynbatchd import hookspecs
from dynbatchd.config.schema import SHARED_TABLES
from dynbatchd.config.shared import plugin_keys_of
from dynbatchd.errors import ConfigError, DynbatchdError, OptionError
from dynbatchd.hookspecs import RequestInfo, Violation, WarmupJob

log = logging.getLogger(__name__)


class PluginError(DynbatchdError):
    """A plugin is broken in a way the daemon cannot run around."""


@dataclass(frozen=True)
class PluginInfo:
    name: str
    module: str
    hooks: tuple[str, ...]
    source: str  # distribution that provides it


def _direct_calls(hook: Any, signature: tuple[str, ...]) -> list[Callable[..., Any]] | None:
    """The implementations as plain functions taking `signature` positionally, in pluggy's
    call order; None when a wrapper is registered and pluggy must run the call itself."""
    impls = hook.get_hookimpls()
    if any(i.hookwrapper or getattr(i, "wrapper", False) for i in impls):
        return None
    calls = []
    for impl in reversed(impls):
        if tuple(impl.argnames) == signature:
            calls.append(impl.function)
        else:  # pluggy lets an implementation take a subset of the arguments, by name
            def adapted(*values: Any, fn=impl.function, names=tuple(impl.argnames)) -> Any:
                given = dict(zip(signature, values))
                return fn(*[given[n] for n in names])
            calls.append(adapted)
    return calls


class Plugins:
    def __init__(self, pm: pluggy.PluginManager, broken: dict[str, str], sources: dict[str, str]):
        self.pm = pm
        self.broken = broken
        self.sources = sources
        self.has_admission_checks = bool(pm.hook.dynbatchd_admit.get_hookimpls())
        self._route_impls = _direct_calls(pm.hook.dynbatchd_route, ("request", "config"))
        self._admit_impls = _direct_calls(pm.hook.dynbatchd_admit, ("request", "channel", "config"))

    # -- building ---------------------------------------------------------
    @classmethod
    def load(cls, extra: list[object] | None = None, *, entry_point_group: str = hookspecs.PROJECT) -> "Plugins":
        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        broken: dict[str, str] = {}
        sources: dict[str, str] = {}
        for ep in entry_points(group=entry_point_group):
            if pm.get_plugin(ep.name) is not None:
                continue
            try:
                module = ep.load()
            except Exception as exc:  # a broken plugin must not take the daemon down
                broken[ep.name] = f"{type(exc).__name__}: {exc}"
                log.error("plugin %s failed to load and is skipped: %s", ep.name, exc)
                continue
            pm.register(module, name=ep.name)
            sources[ep.name] = f"{ep.dist.name} {ep.dist.version}" if ep.dist else ""
        for plugin in extra or ():
            pm.register(plugin)
        try:
            pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(str(exc)) from None
        return cls(pm, broken, sources)

    def describe(self) -> list[PluginInfo]:
        out = []
        for name, plugin in sorted(self.pm.list_name_plugin(), key=lambda x: x[0]):
            hooks = tuple(sorted(h.name for h in self.pm.get_hookcallers(plugin) or ()))
            out.append(PluginInfo(name, getattr(plugin, "__name__", type(plugin).__name__),
                                  hooks, self.sources.get(name, "")))
        return out

    # -- one method per hook ------------------------------------------------
    # route and admit run once per request: they call the implementations directly, in
    # pluggy's order, unless a wrapper needs pluggy's machinery (see _direct_calls).
    def route(self, request: RequestInfo, config: Any) -> str:
        if self._route_impls is None:
            channel = self.pm.hook.dynbatchd_route(request=request, config=config)
            return channel if channel is not None else config.routing.default
        for fn in self._route_impls:
            channel = fn(request, config)
            if channel is not None:
                return channel
        return config.routing.default

    def channel_for(self, request: RequestInfo, config: Any) -> str:
        """The routing hook's answer, or the default channel when it names none that exists
        (the daemon and the simulator route through this one call)."""
        channel = self.route(request, config)
        if channel not in config.channels:
            log.error("routing named unknown channel %r; using %r", channel, config.routing.default)
            channel = config.routing.default
        return channel

    def admit(self, request: RequestInfo, channel: str, config: Any) -> str | None:
        if self._admit_impls is None:
            answers = self.pm.hook.dynbatchd_admit(request=request, channel=channel, config=config)
        else:
            answers = [fn(request, channel, config) for fn in self._admit_impls]
        return "; ".join(r for r in answers if r) if any(answers) else None

    def check_config(self, config: Any) -> list[Violation]:
        found: list[Violation] = []
        for impl_result in self.pm.hook.dynbatchd_check_config(config=config):
            found.extend(impl_result or ())
        return found

    def warmup_jobs(self, model: str, top_users: int, config: Any) -> list[WarmupJob]:
        jobs: list[WarmupJob] = []
        for answer in self.pm.hook.dynbatchd_warmup(model=model, top_users=top_users, config=config):
            jobs.extend(answer if isinstance(answer, list) else [answer] if answer else [])
        return jobs

    def _registry(self, hook: Any, what: str) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for table in hook():
            for name, factory in (table or {}).items():
                if name in merged and merged[name] is not factory:
                    raise PluginError(f"{what} {name!r} is registered by two plugins")
                merged[name] = factory
        return merged

    def window_policies(self) -> dict[str, Any]:
        return self._registry(self.pm.hook.dynbatchd_window_policies, "window policy")

    def batch_sizers(self) -> dict[str, Any]:
        return self._registry(self.pm.hook.dynbatchd_batch_sizers, "batch-size policy")

    def runners(self) -> dict[str, Any]:
        return self._registry(self.pm.hook.dynbatchd_runners, "runner")

    def sequence_caps(self, models: Any) -> dict[str, int]:
        """Model name -> the most tokens of one request its runner reads (`Runner.sequence_cap`)."""
        from dynbatchd.devices.runners import sequence_caps   # (numpy: only where a daemon or simulator asks)

        return sequence_caps(models, self.runners())

    def cache_policies(self) -> dict[str, Any]:
        return self._registry(self.pm.hook.dynbatchd_cache_policies, "cache policy")

    def config_tables(self) -> dict[str, type]:
        """``{name: struct type}`` of the tables plugins own (`dynbatchd_config_tables`); two that
        claim one top-level table (``table_key``) are a PluginError."""
        tables = self._registry(self.pm.hook.dynbatchd_config_tables, "config table")
        claimed: dict[str, str] = {}
        for name, typ in tables.items():
            key = getattr(typ, "table_key", "")
            if key and claimed.setdefault(key, name) != name:
                raise PluginError(f"config tables {claimed[key]!r} and {name!r} both claim [{key}]")
        return tables

    @staticmethod
    def _where(config: Any, name: str, typ: type) -> tuple[str, Any]:
        """(key, raw table) of NAME: ``[plugins.NAME]``, or what a struct claims with ``table_key``:
        the plugins' keys of a shared table (``[routing]``, ``[compliance]``, ``[cache]``:
        `dynbatchd.config.shared`), or a top-level table the core keeps free-form for its plugin
        (the HTTP plugin's ``[http]``)."""
        key = getattr(typ, "table_key", "")
        if key in SHARED_TABLES:
            return key, plugin_keys_of(config, key)
        if key:
            if not isinstance(getattr(config, key, None), dict):
                raise PluginError(f"config table {name!r} claims [{key}], which the core keeps for no plugin")
            return key, getattr(config, key)
        return f"plugins.{name}", config.plugins.get(name, {})

    def table(self, config: Any, name: str) -> Any:
        """NAME's table of `config` as its owner's struct (its defaults where the table is absent);
        a ConfigError (file, ``plugins.NAME.KEY``, rule) where it breaks the struct's rules."""
        from dynbatchd.config import convert

        typ = self.config_tables()[name]
        key, raw = self._where(config, name, typ)
        return convert(raw, typ, config.source, key)

    def check_tables(self, config: Any) -> None:
        """Every owned table of `config` converts (`table`) and passes its struct's ``check(config)``
        (rules across tables, raising OptionError with the key within the table), or the first ConfigError.
        A key of a shared table that is neither the core's nor a loaded plugin's is an unknown field."""
        tables = self.config_tables()
        claimed = {getattr(typ, "table_key", "") for typ in tables.values()}
        for table, keys in (getattr(config, "plugin_keys", None) or {}).items():
            if keys and table not in claimed:
                raise ConfigError(config.source, table, f"object contains unknown field `{next(iter(keys))}` "
                                  "(the core has no such key, and no loaded plugin owns one)")
        for name, typ in tables.items():
            key, _ = self._where(config, name, typ)
            if key != f"plugins.{name}" and name in config.plugins:
                raise ConfigError(config.source, f"plugins.{name}", f"this table is spelled [{key}]")
            settings = self.table(config, name)
            try:
                getattr(settings, "check", lambda _config: None)(config)
            except OptionError as exc:
                raise ConfigError.of_option(config.source, key, exc) from None

    def front_doors(self) -> dict[str, Any]:
        return self._registry(self.pm.hook.dynbatchd_front_doors, "front door")
