"""Compliance rules from the guide.

- Config: a channel carrying ``banking`` traffic may not wait longer than
  ``compliance.banking_max_window_ms`` (150 ms: the SLA's clause 3.2).
- Config: regulated traffic (``compliance.regulated_tags``: medical, financial,
  banking) may only be routed to isolated channels.
- Request: a request tagged with a regulated tag is refused unless routing put
  it in an isolated channel, so its data never shares a batch with another
  tenant's.

The two keys are this plugin's, in the shared ``[compliance]`` table
(`dynbatchd_plugins.compliance_config`). A channel carries a tag when its ``carries``
names it or a routing rule of the routing plugin sends that tag to it
(`dynbatchd.config.channels_carrying`).

Tags are compared as `tag_key` spells them (case and surrounding whitespace ignored), in requests,
``regulated_tags``, ``carries`` and routing rules alike: a regulated tag spelt "Banking" is still
regulated. Routing itself matches tags exactly, so such a request may reach an open channel, and
is then refused here rather than batched with other tenants' data.
"""

from __future__ import annotations

from dynbatchd.config import PerConfig, channels_carrying
from dynbatchd.hookspecs import RequestInfo, Violation, hookimpl
from dynbatchd_plugins.compliance_config import (  # noqa: F401  (dynbatchd_config_tables: its keys)
    compliance_rules, dynbatchd_config_tables, regulated_keys, tag_key)
from dynbatchd_plugins.routing_config import routing_rules

PLUGIN = "compliance"


@hookimpl
def dynbatchd_check_config(config) -> list[Violation]:
    found = []
    rules, routes = compliance_rules(config), routing_rules(config).rules
    limit = rules.banking_max_window_ms
    for name in sorted(channels_carrying(config.channels, "banking", routes, tag_key)):
        channel = config.channels[name]
        if channel.window_ms > limit:
            found.append(Violation(
                f"channels.{name}.window_ms",
                f"channel carries banking traffic, so its window may not exceed {limit:g} ms "
                f"(SLA clause 3.2); it is {channel.window_ms:g} ms", PLUGIN))
    for tag in sorted(regulated_keys(config)):
        for name in sorted(channels_carrying(config.channels, tag, routes, tag_key)):
            if not config.channels[name].isolated:
                found.append(Violation(
                    f"channels.{name}.isolated",
                    f"channel carries regulated {tag!r} traffic, so it must be isolated = true", PLUGIN))
    return found


REGULATED = PerConfig(regulated_keys)   # once per config


@hookimpl
def dynbatchd_admit(request: RequestInfo, channel: str, config) -> str | None:
    if not request.tags:
        return None
    last = REGULATED.last
    regulated = last[1] if last[0] is config else REGULATED(config)
    hits = [t for t in request.tags if tag_key(t) in regulated]
    if hits and not config.channels[channel].isolated:
        return (f"request tagged {hits[0]!r} was routed to channel {channel!r}, which is not "
                f"isolated; regulated data is batched only in isolated channels")
    return None
