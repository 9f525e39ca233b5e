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
"""

from __future__ import annotations

from typing import Callable

from dynbatchd.cache import AGAIN, ALWAYS, FILTER
from dynbatchd.hookspecs import CacheRule, RequestInfo, hookimpl

Policy = Callable[[RequestInfo], CacheRule]


def lifecycle(settings) -> Policy:
    rare, refresh = frozenset(settings.rare_users), frozenset(settings.refresh_types)
    again, always, filtered = CacheRule(store=AGAIN), CacheRule(store=ALWAYS), CacheRule(store=FILTER)

    def rule(request: RequestInfo) -> CacheRule:
        if request.user_frequency in rare:
            return again
        return always if request.request_type in refresh else filtered
    return rule


def lru(settings) -> Policy:
    always = CacheRule(store=ALWAYS)
    return lambda request: always


@hookimpl
def dynbatchd_cache_policies() -> dict[str, object]:
    return {"lifecycle": lifecycle, "lru": lru}
