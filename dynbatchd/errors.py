"""The errors dynbatchd raises on purpose, under one base class.

A caller that means "anything dynbatchd refused or could not do" catches
`DynbatchdError`; one that needs the detail reads attributes, never the text:
a `ConfigError` carries the file, the key and the rule it broke, an
`OptionError` the key and the rule. Their messages are built from those
attributes, so the text and the attributes cannot disagree.
"""

from __future__ import annotations


class DynbatchdError(Exception):
    """The base of every error dynbatchd raises on purpose (not of bugs, not of OS errors)."""


class OptionError(DynbatchdError, ValueError):
    """A setting that breaks a rule, before any file is known: `key` names it (e.g. a runner's
    option, or ``channels.rt.window.options.alpha``), `rule` says why; ``str()`` is ``key: rule``.

    Also a ValueError: runners and policies raised ValueError before this class, and
    callers that catch ValueError keep working."""

    def __init__(self, key: str, rule: str):
        self.key, self.rule = key, rule
        super().__init__(f"{key}: {rule}" if key else rule)

    @property
    def option(self) -> str:
        """The name a runner's option checker gives `key` (relative to ``options``)."""
        return self.key


class ConfigError(DynbatchdError):
    """A configuration that cannot be used: `file`, `key` (empty: the file as a whole) and
    `rule`; ``str()`` is ``file: key: rule``."""

    def __init__(self, file: str, key: str, rule: str):
        self.file, self.key, self.rule = file, key, rule
        super().__init__(f"{file}: {key}: {rule}" if key else f"{file}: {rule}")

    @classmethod
    def of_option(cls, file: str, prefix: str, exc: OptionError) -> "ConfigError":
        """`exc` (an option's key relative to `prefix`) as the error of the config file `file`."""
        return cls(file, ".".join(p for p in (prefix, exc.key) if p), exc.rule)
