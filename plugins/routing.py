"""Route by the `[routing]` rules of the config: first matching rule wins.

The rules are this plugin's keys of the shared ``[routing]`` table (`dynbatchd_plugins.routing_config`:
their shape and rules); the core keeps ``[routing] default``, where a request no rule matches goes.
The shipped config encodes the guide's K12 routing: tokens > 8192 -> bulk,
tag ``urgent`` -> realtime, everything else -> the default (standard).
"""

from __future__ import annotations

from dynbatchd.config import PerConfig
from dynbatchd.hookspecs import RequestInfo, hookimpl
from dynbatchd_plugins.routing_config import dynbatchd_config_tables, routing_rules  # noqa: F401  (rules)

RULES = PerConfig(lambda config: routing_rules(config).rules)   # converted once per config, not per request


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
    last = RULES.last
    for rule in last[1] if last[0] is config else RULES(config):
        if matches(rule, request):
            return rule.channel
    return None
