"""Shared tables: ``[routing]``, ``[compliance]`` and ``[cache]`` hold the core's keys and a plugin's.

The core's keys of these tables are its structs' fields (`dynbatchd.config.schema.SHARED_TABLES`:
``[routing] default``, ``[compliance] key_tenants`` and ``audit_log``, ``[cache] entries``,
``max_bytes``, ``policy`` and ``warmup_channel``). Every other key of them is a plugin's: `parse`
sets it aside (`split`) into ``Config.plugin_keys[TABLE]``, and the plugin whose config-table
struct claims the table (``table_key = "routing"``, see the ``dynbatchd_config_tables`` hook)
gives it its shape and rules: `dynbatchd.plugins.Plugins.check_tables` converts and checks it at
validation, and refuses, as an unknown field, a key that no loaded plugin claims. The built-ins:
the routing plugin owns ``[routing] rules`` (`dynbatchd_plugins.routing_config`), the compliance
plugin ``[compliance] regulated_tags`` and ``banking_max_window_ms``
(`dynbatchd_plugins.compliance_config`), the cache plugin's ``lifecycle`` policy ``[cache]
refresh_types`` and ``rare_users`` (`dynbatchd_plugins.cache`). A file spells them as it always
did; `fold` puts them back where it had them (`dynbatchd.config.to_dict`).
"""

from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

import msgspec

from dynbatchd.config.schema import SHARED_TABLES

T = TypeVar("T")

_CORE_KEYS = {name: frozenset(f.encode_name for f in msgspec.structs.fields(typ))
              for name, typ in SHARED_TABLES.items()}


def split_table(name: str, table: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Shared table NAME as a file spells it -> (the core's keys, the plugins' keys)."""
    core = _CORE_KEYS[name]
    return ({k: v for k, v in table.items() if k in core}, {k: v for k, v in table.items() if k not in core})


def split(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """A TOML-shaped config -> (it with the shared tables' plugin keys taken out, those keys by table).
    A shared table that is not a table is left as it is, for the struct's error."""
    data, owned = dict(data), {}
    for name in SHARED_TABLES:
        table = data.get(name)
        if isinstance(table, dict):
            data[name], extra = split_table(name, table)
            if extra:
                owned[name] = extra
    return data, owned


def fold(data: dict[str, Any], plugin_keys: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The reverse of `split`: each table's plugin keys back into it (`data` changed and returned)."""
    for name, keys in plugin_keys.items():
        data[name] = {**data.get(name, {}), **keys}
    return data


def plugin_keys_of(config: Any, name: str) -> dict[str, Any]:
    """The plugins' keys of shared table NAME in `config`, as the file spells them (empty: none)."""
    return (getattr(config, "plugin_keys", None) or {}).get(name, {})


def table_of(config: Any, name: str) -> dict[str, Any]:
    """Shared table NAME of `config` whole, as the file spells it: the core's keys and the plugins'
    (e.g. a config's ``[routing]``, default and rules, for the simulator: `dynbatchd.simulate.simulate`)."""
    return {**msgspec.to_builtins(getattr(config, name)), **plugin_keys_of(config, name)}


class PerConfig(Generic[T]):
    """`build(config)` once per config object: calling it gives the answer again while it is asked
    about the same object (compared by identity; a reload's new config is built anew). For hooks
    that run per request (routing, admission) and read a plugin's table: the table is converted
    once, not per request. The last `KEEP` configs' answers are kept, so a simulation of a
    candidate config in another thread does not make the live one's be built again per request.
    ``last`` is the latest (config, answer) pair, swapped in whole (a thread never sees one
    config's answer beside another); a hook on the request path reads it inline, saving the call::

        last = RULES.last
        rules = last[1] if last[0] is config else RULES(config)
    """
    __slots__ = ("build", "last", "recent")
    KEEP = 4

    def __init__(self, build: Callable[[Any], T]):
        self.build = build
        self.last: tuple[Any, Any] = (object(), None)
        self.recent: tuple[tuple[Any, Any], ...] = ()

    def __call__(self, config: Any) -> T:
        recent = self.recent
        entry = next((e for e in recent if e[0] is config), None) or (config, self.build(config))
        self.recent = (entry, *(e for e in recent if e is not entry))[: self.KEEP]
        self.last = entry
        return entry[1]
