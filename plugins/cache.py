"""The built-in result-cache policies: `lifecycle` (the default) and `lru`.

`lifecycle` reads the two request fields the guide's sales-peak fix relies on:

    user_frequency in [cache] rare_users ("rare")  -> kept only if asked before
    request_type in [cache] refresh_types           -> kept always (a refresh
        ("session_refresh")                            is asked again by nature)
    anything else (new sessions, untagged)          -> kept only if asked more
                                                       often than what it replaces

Every request may be answered from the cache. `lru` keeps every result and
drops the least recently used: the untagged baseline the sales-peak scenario
compares against.

``refresh_types`` and ``rare_users`` are this plugin's keys of the shared ``[cache]``
table (`LifecycleSettings`, declared through `dynbatchd_config_tables`); the core keeps
``entries``, ``max_bytes``, ``policy`` and ``warmup_channel``.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import msgspec

from dynbatchd.cache import AGAIN, ALWAYS, FILTER
from dynbatchd.config import Frozen, plugin_table
from dynbatchd.hookspecs import CacheRule, RequestInfo, hookimpl

Policy = Callable[[RequestInfo], CacheRule]


class LifecycleSettings(Frozen, kw_only=True):
    """The ``lifecycle`` policy's keys of ``[cache]``: request types always kept, user frequencies
    kept only once asked again."""
    table_key: ClassVar[str] = "cache"   # keys of the shared [cache], beside the core's

    refresh_types: list[str] = msgspec.field(default_factory=lambda: ["session_refresh"])
    rare_users: list[str] = msgspec.field(default_factory=lambda: ["rare"])


def lifecycle_settings(config: Any) -> LifecycleSettings:
    """``[cache]``'s lifecycle keys of `config` as their struct (the defaults where none is set)."""
    return plugin_table(config, LifecycleSettings)


def lifecycle(config: Any) -> Policy:
    settings = lifecycle_settings(config)
    rare, refresh = frozenset(settings.rare_users), frozenset(settings.refresh_types)
    again, always, filtered = CacheRule(store=AGAIN), CacheRule(store=ALWAYS), CacheRule(store=FILTER)

    def rule(request: RequestInfo) -> CacheRule:
        if request.user_frequency in rare:
            return again
        return always if request.request_type in refresh else filtered
    return rule


def lru(config: Any) -> Policy:
    always = CacheRule(store=ALWAYS)
    return lambda request: always


@hookimpl
def dynbatchd_cache_policies() -> dict[str, object]:
    return {"lifecycle": lifecycle, "lru": lru}


@hookimpl
def dynbatchd_config_tables() -> dict[str, type]:
    return {"cache": LifecycleSettings}
