"""Compliance rules from the guide.

- Config: a channel carrying ``banking`` traffic may not wait longer than
  ``compliance.banking_max_window_ms`` (150 ms: the SLA's clause 3.2).
- Config: regulated traffic (``compliance.regulated_tags``: medical, financial,
  banking) may only be routed to isolated channels.
- Request: a request tagged with a regulated tag is refused unless routing put
  it in an isolated channel, so its data never shares a batch with another
  tenant's.
"""

from __future__ import annotations

from dynbatchd.hookspecs import RequestInfo, Violation, hookimpl

PLUGIN = "compliance"


@hookimpl
def dynbatchd_check_config(config) -> list[Violation]:
    found = []
    limit = config.compliance.banking_max_window_ms
    for name in sorted(config.channels_carrying("banking")):
        channel = config.channels[name]
        if channel.window_ms > limit:
            found.append(Violation(
                f"channels.{name}.window_ms",
                f"channel carries banking traffic, so its window may not exceed {limit:g} ms "
                f"(SLA clause 3.2); it is {channel.window_ms:g} ms", PLUGIN))
    for tag in config.compliance.regulated_tags:
        for name in sorted(config.channels_carrying(tag)):
            if not config.channels[name].isolated:
                found.append(Violation(
                    f"channels.{name}.isolated",
                    f"channel carries regulated {tag!r} traffic, so it must be isolated = true", PLUGIN))
    return found


@hookimpl
def dynbatchd_admit(request: RequestInfo, channel: str, config) -> str | None:
    if not request.tags:
        return None
    regulated = [t for t in request.tags if t in config.compliance.regulated_tags]
    if regulated and not config.channels[channel].isolated:
        return (f"request tagged {regulated[0]!r} was routed to channel {channel!r}, which is not "
                f"isolated; regulated data is batched only in isolated channels")
    return None
