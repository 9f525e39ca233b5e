"""Route by the `[routing]` rules of the config: first matching rule wins.

The shipped config encodes the guide's K12 routing: tokens > 8192 -> bulk,
tag ``urgent`` -> realtime, everything else -> the default (standard).
"""

from __future__ import annotations

from dynbatchd.hookspecs import RequestInfo, hookimpl


def matches(rule, request: RequestInfo) -> bool:
    """True when every condition the rule sets holds for the request."""
    if rule.model is not None and request.model != rule.model:
        return False
    if rule.tag is not None and rule.tag not in request.tags:
        return False
    if rule.tokens_above is not None and request.tokens <= rule.tokens_above:
        return False
    if rule.request_type is not None and request.request_type != rule.request_type:
        return False
    if rule.user_frequency is not None and request.user_frequency != rule.user_frequency:
        return False
    if rule.priority_at_least is not None and (request.priority is None or request.priority < rule.priority_at_least):
        return False
    return True


@hookimpl(trylast=True)
def dynbatchd_route(request: RequestInfo, config) -> str | None:
    for rule in config.routing.rules:
        if matches(rule, request):
            return rule.channel
    return None
