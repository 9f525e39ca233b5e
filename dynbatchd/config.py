"""TOML configuration: parsed into frozen, typed settings.

Every error names the file, the key and the rule broken, e.g.
``etc/dynbatchd.toml: channels.realtime.max_batch: expected `int` >= 1, got `0```.
Unknown keys are errors, not silently ignored.
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIG_ENV = "DYNBATCHD_CONFIG"
# Searched in this order after --config and $DYNBATCHD_CONFIG (see `find_config`).
DEFAULT_CONFIG_PATHS = ("etc/dynbatchd.toml", "/etc/dynbatchd/dynbatchd.toml")

# Upper bounds, so no setting can overflow the nanosecond arithmetic of the
# scheduler or the msgpack integers of the control protocol. MAX_MS is the
# wire protocol's own limit on a request's deadline_ms (one day).
MAX_MS = 86_400_000.0
MAX_S = MAX_MS / 1000
MAX_BATCH = 65_536
MAX_QUEUE = 1 << 24
MAX_TOKENS = 2**31 - 1
MAX_PRIORITY = 1_000_000

NonNegative = Annotated[int, Meta(ge=0, le=MAX_TOKENS)]
Millis = Annotated[float, Meta(ge=0, le=MAX_MS)]
Seconds = Annotated[float, Meta(ge=0, le=MAX_S)]
Priority = Annotated[int, Meta(ge=-MAX_PRIORITY, le=MAX_PRIORITY)]


class ConfigError(Exception):
    """A configuration that cannot be used; `str()` names file, key and rule."""

    def __init__(self, file: str, key: str, rule: str):
        self.file, self.key, self.rule = file, key, rule
        super().__init__(f"{file}: {key}: {rule}" if key else f"{file}: {rule}")


class Frozen(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class DaemonSettings(Frozen, kw_only=True):
    listen: str = "tcp://127.0.0.1:5555"
    control: str = "tcp://127.0.0.1:5556"
    metrics_listen: str = ""
    max_request_bytes: Annotated[int, Meta(ge=1, le=1 << 30)] = 1 << 20
    drain_timeout_s: Seconds = 30.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"


class DeviceSettings(Frozen, kw_only=True):
    use: str | list[str] = "auto"
    inflight: Annotated[int, Meta(ge=1, le=8)] = 2
    queue_lead_ms: Millis = 1.0
    cpu_threads: Annotated[int, Meta(ge=0, le=4096)] = 0
    memory_gb: Annotated[float, Meta(ge=0, le=1 << 20)] = 0.0
    restart_limit: Annotated[int, Meta(ge=0, le=1_000_000)] = 5
    batch_timeout_s: Seconds = 120.0


class ModelSettings(Frozen, kw_only=True):
    runner: str
    options: dict[str, Any] = {}


class WindowSettings(Frozen, kw_only=True):
    policy: str = "fixed"
    options: dict[str, Any] = {}


class ChannelSettings(Frozen, kw_only=True):
    max_batch: Annotated[int, Meta(ge=1, le=MAX_BATCH)]
    window_ms: Millis
    deadline_ms: Annotated[float, Meta(gt=0, le=MAX_MS)] = 1000.0
    queue_limit: Annotated[int, Meta(ge=1, le=MAX_QUEUE)] = 1024
    priority: Priority = 0
    isolated: bool = False
    run_late: bool = False
    max_tokens: NonNegative = 0
    token_buckets: list[NonNegative] = []
    min_share: Annotated[float, Meta(ge=0, le=1)] = 0.0
    carries: list[str] = []
    window: WindowSettings | None = None
    batch_size: WindowSettings | None = None


class RoutingRule(Frozen, kw_only=True):
    channel: str
    tag: str | None = None
    tokens_above: NonNegative | None = None
    request_type: str | None = None
    user_frequency: str | None = None
    priority_at_least: Priority | None = None
    model: str | None = None


class RoutingSettings(Frozen, kw_only=True):
    default: str = "standard"
    rules: list[RoutingRule] = []


class ComplianceSettings(Frozen, kw_only=True):
    regulated_tags: list[str] = msgspec.field(default_factory=lambda: ["banking", "medical", "financial"])
    banking_max_window_ms: Millis = 150.0


class CacheSettings(Frozen, kw_only=True):
    entries: Annotated[int, Meta(ge=0, le=MAX_QUEUE * 16)] = 0
    warmup_channel: str = ""


class Config(Frozen, kw_only=True):
    daemon: DaemonSettings = DaemonSettings()
    devices: DeviceSettings = DeviceSettings()
    models: dict[str, ModelSettings]
    channels: dict[str, ChannelSettings]
    routing: RoutingSettings = RoutingSettings()
    compliance: ComplianceSettings = ComplianceSettings()
    cache: CacheSettings = CacheSettings()
    plugins: dict[str, dict[str, Any]] = {}
    source: str = "<memory>"

    def window_of(self, channel: str) -> WindowSettings:
        return self.channels[channel].window or WindowSettings()

    def channels_carrying(self, tag: str) -> set[str]:
        """Channels that declare `tag` traffic or that a routing rule sends it to."""
        named = {n for n, c in self.channels.items() if tag in c.carries}
        return named | {r.channel for r in self.routing.rules if r.tag == tag}


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


def _convert(data: Any, typ: type, source: str, prefix: str = "") -> Any:
    """msgspec.convert, with its error turned into a ConfigError naming the full key and the value."""
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


def parse(data: dict[str, Any], source: str = "<memory>") -> Config:
    """Validate a TOML-shaped mapping: structure here, cross-references in `_check_references`."""
    data = dict(data)
    if "source" in data:
        raise ConfigError(source, "", "unknown field `source`")
    # Tables keyed by user-chosen names are converted entry by entry so an error names the entry.
    for section, typ in (("models", ModelSettings), ("channels", ChannelSettings)):
        table = data.get(section)
        if isinstance(table, dict):
            data[section] = {name: _convert(sub, typ, source, f"{section}.{name}") for name, sub in table.items()}
    cfg = _convert({**data, "source": source}, Config, source)
    _check_references(cfg)
    return cfg


def _check_references(cfg: Config) -> None:
    src = cfg.source
    if not cfg.channels:
        raise ConfigError(src, "channels", "at least one channel is required")
    if not cfg.models:
        raise ConfigError(src, "models", "at least one model is required")
    if cfg.routing.default not in cfg.channels:
        raise ConfigError(src, "routing.default", f"names unknown channel {cfg.routing.default!r}")
    if cfg.cache.warmup_channel and cfg.cache.warmup_channel not in cfg.channels:
        raise ConfigError(src, "cache.warmup_channel", f"names unknown channel {cfg.cache.warmup_channel!r}")
    for i, rule in enumerate(cfg.routing.rules):
        if rule.channel not in cfg.channels:
            raise ConfigError(src, f"routing.rules[{i}].channel", f"names unknown channel {rule.channel!r}")
        if rule.model is not None and rule.model not in cfg.models:
            raise ConfigError(src, f"routing.rules[{i}].model", f"names unknown model {rule.model!r}")
    for name, ch in cfg.channels.items():
        if ch.window_ms > ch.deadline_ms:
            raise ConfigError(src, f"channels.{name}.window_ms",
                              f"window {ch.window_ms:g} ms exceeds the channel deadline {ch.deadline_ms:g} ms")
        if ch.token_buckets != sorted(set(ch.token_buckets)):
            raise ConfigError(src, f"channels.{name}.token_buckets", "must be strictly increasing token counts")
    for ep_key in ("listen", "control"):
        ep = getattr(cfg.daemon, ep_key)
        if not re.match(r"^(tcp|ipc|inproc)://.+", ep):
            raise ConfigError(src, f"daemon.{ep_key}", f"{ep!r} is not a ZeroMQ endpoint (tcp://, ipc://)")
    if not is_private_endpoint(cfg.daemon.control):
        raise ConfigError(src, "daemon.control",
                          f"{cfg.daemon.control!r} is not a loopback address: the control socket has no "
                          "authentication, so it must be tcp://127.0.0.1:PORT, tcp://[::1]:PORT, "
                          "tcp://localhost:PORT or an ipc:// path")
    if cfg.daemon.metrics_listen and not re.match(r"^[\w.\-\[\]:]*:\d{1,5}$", cfg.daemon.metrics_listen):
        raise ConfigError(src, "daemon.metrics_listen", f"{cfg.daemon.metrics_listen!r} is not HOST:PORT")
    if isinstance(cfg.devices.use, str) and cfg.devices.use != "auto":
        raise ConfigError(src, "devices.use", 'must be "auto" or a list such as ["cuda:0", "cpu"]')
    if isinstance(cfg.devices.use, list):
        for i, dev in enumerate(cfg.devices.use):
            if not re.match(r"^(cpu|cuda:\d+)$", dev):
                raise ConfigError(src, f"devices.use[{i}]", f"{dev!r} is not a device (cpu, cuda:N)")


def is_private_endpoint(endpoint: str) -> bool:
    """True for ipc:// and inproc:// endpoints and for tcp:// on a loopback address only.

    A wildcard (`tcp://*:5556`), an interface name or any other address is not:
    whoever can reach it could retune and stop the daemon.
    """
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[len("tcp://"):].rpartition(":")[0]
    host = host.rpartition(";")[2]          # tcp://SOURCE;HOST:PORT binds HOST
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def find_config(explicit: str | Path | None = None) -> Path | None:
    """The config file a command reads: the one search order of every dynbatchd and dynbatchctl command.

    1. `explicit` (the command's --config), 2. ``$DYNBATCHD_CONFIG``,
    3. ``./etc/dynbatchd.toml``, 4. ``/etc/dynbatchd/dynbatchd.toml``.
    The first two are returned as given even when no such file exists (reading
    it then fails, naming it); the last two count only where they are files.
    None when no file is found.
    """
    if explicit is not None and str(explicit) != "":
        return Path(explicit)
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV])
    for candidate in map(Path, DEFAULT_CONFIG_PATHS):
        if candidate.is_file():
            return candidate
    return None


def search_order_text() -> str:
    """The search order in words, for error messages."""
    return "--config, $" + CONFIG_ENV + ", " + ", ".join(("./" + p) if not p.startswith("/") else p
                                                         for p in DEFAULT_CONFIG_PATHS)


def load(path: str | Path) -> Config:
    """Read and structurally validate a TOML file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(str(path), "", f"cannot read: {exc.strerror}") from None
    try:
        data = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), "", f"not valid TOML: {exc}") from None
    return parse(data, str(path))


def check_channel_values(channel: str, changes: dict[str, Any], source: str = "tune") -> None:
    """Type and range of channel settings on their own (what `tune` sends), before any daemon sees them.

    Raises the ConfigError a config file with these values would get; rules
    across settings (window within the deadline, compliance) need the whole
    configuration and stay with the daemon.
    """
    _convert({"max_batch": 1, "window_ms": 0.0, **changes}, ChannelSettings, source, f"channels.{channel}")


def with_channel(cfg: Config, name: str, **changes: Any) -> Config:
    """A copy of `cfg` with one channel's settings changed (used by `tune`)."""
    channels = dict(cfg.channels)
    channels[name] = msgspec.structs.replace(cfg.channels[name], **changes)
    new = msgspec.structs.replace(cfg, channels=channels)
    # Re-run the structural rules so a tuned value obeys the same checks as a loaded one.
    data = msgspec.to_builtins(new)
    del data["source"]
    return parse(data, cfg.source)


def to_dict(cfg: Config) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)
