"""The routing plugin's keys of ``[routing]``: ``rules`` (``[[routing.rules]]``), owned through
`dynbatchd_config_tables`; the core keeps ``default`` (`dynbatchd.config.shared`).

Its own module so that the rules' shape is read without the hook: the compliance plugin asks
which channels the rules send a tag to (`routing_rules`), and a misspelt key of a rule is
refused at validation naming ``routing.rules[0]``, an unknown channel or model naming
``routing.rules[0].channel`` / ``.model``, as when the core kept them.
"""

from __future__ import annotations

from typing import Any, ClassVar

from dynbatchd.config import Frozen, NonNegative, Priority, plugin_table
from dynbatchd.errors import OptionError
from dynbatchd.hookspecs import hookimpl


class RoutingRule(Frozen, kw_only=True):
    """One ``[[routing.rules]]`` entry: where matching requests go, and the conditions (all must hold)."""
    channel: str
    tag: str | None = None
    tokens_above: NonNegative | None = None
    request_type: str | None = None
    user_frequency: str | None = None
    priority_at_least: Priority | None = None
    model: str | None = None


class RoutingRules(Frozen, kw_only=True):
    """The routing plugin's keys of ``[routing]``: its rules, tried in order (the first match wins)."""
    table_key: ClassVar[str] = "routing"   # keys of the shared [routing], beside the core's `default`

    rules: list[RoutingRule] = []

    def check(self, config: Any) -> None:
        """Every rule's channel (and model, if it names one) exists; OptionError(key within ``[routing]``, rule)."""
        for i, rule in enumerate(self.rules):
            if rule.channel not in config.channels:
                raise OptionError(f"rules[{i}].channel", f"names unknown channel {rule.channel!r}")
            if rule.model is not None and rule.model not in config.models:
                raise OptionError(f"rules[{i}].model", f"names unknown model {rule.model!r}")


def routing_rules(config: Any) -> RoutingRules:
    """``[routing]``'s rules of `config` (a Config, or the simulator's: `dynbatchd.engine.intake.sim_config`)
    as this struct (none where the table has none)."""
    return plugin_table(config, RoutingRules)


@hookimpl
def dynbatchd_config_tables() -> dict[str, type]:
    return {"routing": RoutingRules}
