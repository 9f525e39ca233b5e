"""The compliance plugin's keys of ``[compliance]``: ``regulated_tags`` and ``banking_max_window_ms``,
owned through `dynbatchd_config_tables`; the core keeps ``key_tenants`` and ``audit_log`` (tenancy
and the audit trail are the daemon's, whatever plugins check: `dynbatchd.config.shared`).

Its own module so that the table's shape is read without the hooks; a misspelt key
(``regulated_tagz``) is refused at validation naming ``compliance``, a value out of range naming
``compliance.banking_max_window_ms``, as when the core kept them.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from dynbatchd.config import Frozen, Millis, plugin_table
from dynbatchd.hookspecs import hookimpl


class ComplianceRules(Frozen, kw_only=True):
    """Tags whose data is batched only in isolated channels, and the longest window of a channel
    carrying banking traffic (the SLA's clause 3.2)."""
    table_key: ClassVar[str] = "compliance"   # keys of the shared [compliance], beside the core's

    regulated_tags: list[str] = msgspec.field(default_factory=lambda: ["banking", "medical", "financial"])
    banking_max_window_ms: Millis = 150.0


def compliance_rules(config: Any) -> ComplianceRules:
    """``[compliance]``'s rules of `config` as this struct (the defaults where none is set)."""
    return plugin_table(config, ComplianceRules)


def tag_key(tag: str) -> str:
    """A tag as compliance compares it: case and surrounding whitespace ignored, so that a client
    spelling "Banking" or " banking" cannot take regulated data past the rules."""
    return tag.strip().casefold()


def regulated_keys(config: Any) -> frozenset[str]:
    """`config`'s regulated tags, each as `tag_key` spells it."""
    return frozenset(tag_key(tag) for tag in compliance_rules(config).regulated_tags)


@hookimpl
def dynbatchd_config_tables() -> dict[str, type]:
    return {"compliance": ComplianceRules}
