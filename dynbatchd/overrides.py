"""Tuning that outlives a run: the drop-in file ``STATE_DIR/overrides.toml``.

A manual `tune`, a canary's promotion and a rollback change channel settings while the daemon
runs. Each is written here (atomically, TOML) with who made it, when, why, the values before and
after and the risk verdict, and the daemon applies the file after its config file at every start
and reload, so that tuning survives both. The config file stays the base: when a reload finds
the file changed a key this drop-in overrides, the file wins and the override of that key goes.

The running configuration is always ``apply(file config)``: nothing else holds tuned values.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgspec

from dynbatchd import config as cfgmod
from dynbatchd.config import Config, ConfigError

FILE_NAME = "overrides.toml"
TRAIL = 200   # changes kept in the file's trail, newest last
# What may be tuned at run time (and so overridden): `window` is {"policy": NAME, "options": {...}},
# or None for a fixed window (written `window = {}`, since TOML has no null).
TUNABLE = ("max_batch", "window_ms", "deadline_ms", "queue_limit", "max_tokens", "min_share", "long_share", "window")


class Override(msgspec.Struct, forbid_unknown_fields=True):
    value: Any
    since: datetime
    by: str


class Change(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One entry of the trail. `source`: tune, canary (a promotion) or rollback; `undone`: a
    rollback took it back (a rollback steps back to the last change not undone)."""
    channel: str
    at: datetime
    by: str
    source: str
    why: str
    before: dict[str, Any]
    after: dict[str, Any]
    risk: str
    forced: bool = False
    undone: bool = False


class DropIn(msgspec.Struct, forbid_unknown_fields=True):
    channels: dict[str, dict[str, Override]] = {}
    change: list[Change] = []


def now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


class Overrides:
    """The drop-in in memory: the overridden keys of each channel, and the trail of changes."""

    def __init__(self, path: Path | None, data: DropIn | None = None):
        self.path = path
        self.data = data or DropIn()

    @classmethod
    def load(cls, path: Path) -> "Overrides":
        """Read `path` (a missing file is an empty drop-in); ConfigError naming file and key."""
        try:
            parsed = cfgmod.read_toml(path)
        except FileNotFoundError:
            return cls(path)
        data = cfgmod.convert(parsed, DropIn, str(path))
        for channel, keys in data.channels.items():
            for key in keys:
                if key not in TUNABLE:
                    raise ConfigError(str(path), f"channels.{channel}.{key}",
                                      f"not a tunable setting (those are {', '.join(TUNABLE)})")
        return cls(path, data)

    # -- the running configuration ----------------------------------------------------
    def values(self, channel: str) -> dict[str, Any]:
        return {key: _setting(key, o.value) for key, o in self.data.channels.get(channel, {}).items()}

    def apply(self, base: Config) -> Config:
        """`base` (the config file) with every override, checked as a config file; a ConfigError
        names this file and the first key that no longer validates."""
        cfg = base
        source = str(self.path) if self.path else "overrides"
        for channel in self.data.channels:
            if channel not in base.channels:
                raise ConfigError(source, f"channels.{channel}", "no such channel in the config file")
            try:
                cfg = cfgmod.with_channel(cfg, channel, **self.values(channel))
            except ConfigError as exc:
                raise ConfigError(source, exc.key, exc.rule) from None
        return msgspec.structs.replace(cfg, source=base.source)

    # -- changes ------------------------------------------------------------------
    def record(self, channel: str, before: dict[str, Any], after: dict[str, Any], *, by: str, why: str,
               risk: str, forced: bool = False, source: str = "tune") -> Change:
        """Override `after`'s keys of `channel` and add the change to the trail."""
        at = now()
        keys = self.data.channels.setdefault(channel, {})
        for key, value in after.items():
            keys[key] = Override(_stored(value), at, by)
        return self._add(Change(channel=channel, at=at, by=by, source=source, why=why, before=_stored_all(before),
                                after=_stored_all(after), risk=risk, forced=forced))

    def rollback(self, channel: str, base: Config, *, by: str) -> Change | None:
        """Take back the last change of `channel` not yet undone: each of its keys still overridden
        gets its value from before; a key no earlier change set goes back to the config file's
        (`base`). None when there is nothing to take back."""
        keys = self.data.channels.get(channel, {})
        mine = [c for c in self.data.change if c.channel == channel and c.source != "rollback" and not c.undone
                and any(key in keys for key in c.after)]   # a change the config file took over has nothing to undo
        if not mine:
            return None
        last, earlier = mine[-1], mine[:-1]
        last.undone = True
        before, after, at = {}, {}, now()
        for key in last.after:
            if key not in keys:   # the config file took this key over since
                continue
            before[key] = keys[key].value
            if any(key in c.after for c in earlier):
                keys[key] = Override(last.before[key], at, by)
                after[key] = last.before[key]
            else:
                del keys[key]
                after[key] = _stored(cfgmod.to_dict(base.channels[channel]).get(key))
        if not keys:
            self.data.channels.pop(channel, None)
        return self._add(Change(channel=channel, at=at, by=by, source="rollback", before=before, after=after,
                                why=f"rollback of the {last.source} of {last.at.isoformat()} by {last.by}",
                                risk="not assessed: a rollback restores what ran before"))

    def reconcile(self, old: Config, new: Config) -> list[str]:
        """After a reload from `old` to `new` (both as the config file says): drop the override of
        every key the file changed (the file wins) and of every channel it removed. Returns the
        dropped keys, ``channels.NAME.KEY``."""
        dropped = []
        for channel, keys in list(self.data.channels.items()):
            gone = channel not in new.channels
            for key in list(keys):
                if gone or cfgmod.to_dict(old.channels[channel]).get(key) != \
                        cfgmod.to_dict(new.channels[channel]).get(key):
                    del keys[key]
                    dropped.append(f"channels.{channel}.{key}")
            if not keys:
                del self.data.channels[channel]
        return dropped

    def drop_channel(self, channel: str) -> list[str]:
        keys = self.data.channels.pop(channel, {})
        return [f"channels.{channel}.{key}" for key in keys]

    def copy(self) -> "Overrides":
        """A copy to change and keep only once it is written and applied."""
        return Overrides(self.path, msgspec.convert(msgspec.to_builtins(self.data), DropIn))

    def _add(self, change: Change) -> Change:
        self.data.change.append(change)
        del self.data.change[:-TRAIL]
        return change

    def describe(self) -> dict[str, dict[str, Any]]:
        """For `status`: channel -> key -> {value, since, by}."""
        return {channel: {key: {"value": _setting(key, o.value), "since": o.since.isoformat(), "by": o.by}
                          for key, o in keys.items()}
                for channel, keys in self.data.channels.items()}

    # -- the file -------------------------------------------------------------------
    def save(self) -> None:
        """Write the file atomically (a temporary file renamed over it): a crash leaves the old
        one or the new one, never half of either."""
        assert self.path is not None
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(render(self.data))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:   # e.g. the drop-in's name taken by a directory: leave no temporary file behind
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise


HEADER = """\
# dynbatchd's tuning drop-in: channel settings changed at run time (dynbatchctl tune, a canary's
# promotion, tune --rollback), applied after the config file at every start and reload.
# Written by the daemon. To keep a value for good, put it in the config file: a reload that
# changes a key overridden here drops the override (the file wins). Trail: [[change]], newest last.
"""


def render(data: DropIn) -> str:
    """The drop-in as TOML."""
    lines = [HEADER]
    for channel, keys in data.channels.items():
        lines.append(f"[channels.{_key(channel)}]")
        for key, o in keys.items():
            lines.append(f"{_key(key)} = {{ value = {_value(o.value)}, since = {_value(o.since)}, by = {_value(o.by)} }}")
        lines.append("")
    for c in data.change:
        lines.append("[[change]]")
        for field in Change.__struct_fields__:
            lines.append(f"{field} = {_value(getattr(c, field))}")
        lines.append("")
    return "\n".join(lines)


_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(key: str) -> str:
    return key if _BARE.match(key) else _string(key)


def _string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, datetime):
        return v.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }" if v else "{}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _stored(value: Any) -> Any:
    """A setting as TOML can hold it: a fixed window (None) is an empty table."""
    return {} if value is None else value


def _stored_all(values: dict[str, Any]) -> dict[str, Any]:
    return {k: _stored(v) for k, v in values.items()}


def _setting(key: str, value: Any) -> Any:
    return None if key == "window" and value == {} else value
