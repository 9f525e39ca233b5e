"""Reading a configuration: TOML bytes to a table, a table to a checked `Config`.

msgspec's validation errors become ConfigErrors naming the full key and the value given;
the rules across settings are `dynbatchd.config.rules`'.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import msgspec

from dynbatchd.config.rules import check_names, check_references
from dynbatchd.config.schema import ChannelSettings, Config, GigaBytes, ModelSettings
from dynbatchd.config.shared import fold, plugin_keys_of, split
from dynbatchd.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_PATH_RE = re.compile(r"\s*-\s*at\s*`\$(?P<path>[^`]*)`\s*$")
_STEP_RE = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def _key_from_path(path: str) -> str:
    """msgspec's `$.channels.rt.max_batch` / `$.routing.rules[0]` -> `channels.rt.max_batch`."""
    return path.lstrip(".")


def _value_at(data: Any, path: str) -> Any:
    """The value msgspec's `path` (`.channels.rt.max_batch`, `.use[0]`) points at in `data`, or KeyError."""
    for key, index in _STEP_RE.findall(path):
        data = data[int(index)] if index else data[key]
    return data


def convert(data: Any, typ: type, source: str, prefix: str = "") -> Any:
    """msgspec.convert of `data` to `typ`, with its error turned into a ConfigError of `source` naming
    the full key (under `prefix`) and the value; for any table read from TOML (the drop-in too)."""
    try:
        return msgspec.convert(data, typ)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PATH_RE.search(text)
        path = _key_from_path(match["path"]) if match else ""
        key = ".".join(p for p in (prefix, path) if p).replace(".[", "[")
        rule = _PATH_RE.sub("", text)
        if ", got " not in rule:   # a range error: say what was given, as a type error does
            try:
                value = _value_at(data, match["path"] if match else "")
            except (KeyError, IndexError, TypeError):
                value = None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rule += f", got `{value!r}`"
        raise ConfigError(source, key, rule[:1].lower() + rule[1:]) from None


def plugin_table(config: Any, struct: type) -> Any:
    """`config`'s keys of the shared table that `struct` claims (its ``table_key``: ``routing``,
    ``compliance``, ``cache``) as that struct, its defaults where the file sets none; a ConfigError
    naming the key where they break its rules. What a built-in plugin reads its own keys with."""
    return convert(plugin_keys_of(config, struct.table_key), struct, getattr(config, "source", "<memory>"),
                   struct.table_key)


def parse(data: dict[str, Any], source: str = "<memory>") -> Config:
    """Validate a TOML-shaped mapping: structure here, the rules across settings in `rules.check_references`.
    The keys of the shared tables that plugins own are set aside in ``plugin_keys``, for the plugins'
    structs to check at validation (`dynbatchd.config.shared`)."""
    for field in ("source", "plugin_keys"):   # fields of Config that a file does not spell
        if field in data:
            raise ConfigError(source, "", f"unknown field `{field}`")
    data, plugin_keys = split(data)
    # Tables keyed by user-chosen names are converted entry by entry so an error names the entry.
    for section, typ in (("models", ModelSettings), ("channels", ChannelSettings)):
        table = data.get(section)
        if isinstance(table, dict):
            check_names(source, section, table)   # before an entry's error names a name of megabytes
            data[section] = {name: convert(sub, typ, source, f"{section}.{name}") for name, sub in table.items()}
    memory = data.get("devices", {}).get("memory_gb") if isinstance(data.get("devices"), dict) else None
    if isinstance(memory, dict):   # one device's value at a time, so that the error names the device
        for name, value in memory.items():
            convert(value, GigaBytes, source, f"devices.memory_gb.{name}")
    cfg = convert({**data, "plugin_keys": plugin_keys, "source": source}, Config, source)
    check_references(cfg)
    return cfg


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file's table; ConfigError naming the file when it cannot be read or parsed
    (FileNotFoundError passes through, for callers to whom a missing file means empty)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ConfigError(str(path), "", f"cannot read: {exc.strerror}") from None
    try:
        return tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), "", f"not valid TOML: {exc}") from None
    except RecursionError:   # tomllib recurses once per [ or {: thousands of them exhaust the stack
        raise ConfigError(str(path), "", "not valid TOML: arrays or inline tables nested too deeply") from None
    except Exception as exc:   # the parser's own failure on bytes it did not expect: still this file's fault
        raise ConfigError(str(path), "", f"not valid TOML: {type(exc).__name__}: {exc}") from None


def load(path: str | Path) -> Config:
    """Read and structurally validate a TOML file."""
    path = Path(path)
    try:
        data = read_toml(path)
    except FileNotFoundError as exc:
        raise ConfigError(str(path), "", f"cannot read: {exc.strerror}") from None
    return parse(data, str(path))


def check_channel_values(channel: str, changes: dict[str, Any], source: str = "tune") -> None:
    """Type and range of channel settings on their own (what `tune` sends), before any daemon sees them.

    Raises the ConfigError a config file with these values would get; rules
    across settings (window within the deadline, compliance) need the whole
    configuration and stay with the daemon.
    """
    convert({"max_batch": 1, "window_ms": 0.0, **changes}, ChannelSettings, source, f"channels.{channel}")


def with_channel(cfg: Config, name: str, **changes: Any) -> Config:
    """A copy of `cfg` with one channel's settings changed (used by `tune`)."""
    channels = dict(cfg.channels)
    channels[name] = msgspec.structs.replace(cfg.channels[name], **changes)
    new = msgspec.structs.replace(cfg, channels=channels)
    # Re-run the structural rules so a tuned value obeys the same checks as a loaded one.
    data = to_dict(new)
    del data["source"]
    return parse(data, cfg.source)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config struct as plain data; a whole Config as its file spells it (the plugins' keys of the
    shared tables back in their tables: `parse` of it, less ``source``, reads the same config)."""
    data = msgspec.to_builtins(cfg)
    if isinstance(cfg, Config):
        fold(data, data.pop("plugin_keys"))
    return data
