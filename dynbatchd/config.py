"""TOML configuration: parsed into frozen, typed settings.

Every error names the file, the key and the rule broken, e.g.
``etc/dynbatchd.toml: channels.realtime.max_batch: expected `int` >= 1, got `0```.
Unknown keys are errors, not silently ignored.
"""

from __future__ import annotations

import importlib.util

import errno
import ipaddress
import os
import re
import stat
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
# The control socket's file name in the runtime directory (see `runtime_dir`).
CONTROL_SOCKET = "control.sock"
# The runtime directory systemd makes for dynbatchd.service (RuntimeDirectory=dynbatchd).
SYSTEM_RUNTIME_DIR = "/run/dynbatchd"
# Where the daemon's CURVE keys live: server.key_secret, server.key, clients/*.key, admins/*.key.
DEFAULT_KEYS_DIR = "/etc/dynbatchd/keys"
# The state directory systemd makes for dynbatchd.service (StateDirectory=dynbatchd).
SYSTEM_STATE_DIR = "/var/lib/dynbatchd"
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


def private_runtime_dir(env: dict[str, str] | None = None) -> Path:
    """A directory of this user's own for sockets: ``$XDG_RUNTIME_DIR/dynbatchd``, else
    ``/tmp/dynbatchd-UID``. The daemon creates it mode 0700 (`ensure_private_dir`)."""
    env = os.environ if env is None else env
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        return Path(xdg) / "dynbatchd"
    return Path("/tmp") / f"dynbatchd-{os.getuid()}"


def runtime_dir(env: dict[str, str] | None = None) -> Path:
    """The directory the default control socket lives in; the daemon and dynbatchctl both ask here.

    1. ``$RUNTIME_DIRECTORY`` (the first of its paths): systemd sets it for the
       service (RuntimeDirectory=dynbatchd, so ``/run/dynbatchd``);
    2. ``/run/dynbatchd`` where it exists: the system service is running, so an
       operator's dynbatchctl (or the warmup unit's) finds its socket;
    3. this user's private directory (`private_runtime_dir`), e.g. for a daemon run
       from a checkout.
    """
    env = os.environ if env is None else env
    systemd_dir = env.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if systemd_dir:
        return Path(systemd_dir)
    if os.path.isdir(SYSTEM_RUNTIME_DIR):
        return Path(SYSTEM_RUNTIME_DIR)
    return private_runtime_dir(env)


def default_control(env: dict[str, str] | None = None) -> str:
    """The default ``[daemon] control``: ``ipc://RUNTIME_DIR/control.sock`` (see `runtime_dir`)."""
    return f"ipc://{runtime_dir(env) / CONTROL_SOCKET}"


def default_state_dir(env: dict[str, str] | None = None) -> str:
    """The default ``[daemon] state_dir``: where the daemon and dynbatchctl keep what outlives a
    run (the tuning database, the top-users sketch, promoted settings, the audit log).

    1. ``$STATE_DIRECTORY`` (the first of its paths): systemd sets it for the service
       (StateDirectory=dynbatchd, so ``/var/lib/dynbatchd``);
    2. ``/var/lib/dynbatchd`` where it exists and this user may write it: an operator's
       dynbatchctl (or a timer's) beside the system service;
    3. ``./var`` under the working directory, e.g. for a daemon run from a checkout.
    """
    env = os.environ if env is None else env
    systemd_dir = env.get("STATE_DIRECTORY", "").split(":")[0]
    if systemd_dir:
        return systemd_dir
    if os.path.isdir(SYSTEM_STATE_DIR) and os.access(SYSTEM_STATE_DIR, os.W_OK):
        return SYSTEM_STATE_DIR
    return str(Path.cwd() / "var")


def state_path(settings: "DaemonSettings", name: str) -> Path:
    """The file ``name`` in the state directory, which is created (mode 0750) if missing."""
    directory = Path(settings.state_dir)
    directory.mkdir(mode=0o750, parents=True, exist_ok=True)
    return directory / name


class UnsafeDirectory(OSError):
    """A directory the control socket must not go into; `strerror` says why, in one line."""


def ensure_private_dir(path: str | os.PathLike) -> Path:
    """Create `path` mode 0700 if missing; refuse (UnsafeDirectory) one that another user owns,
    since whoever can reach the control socket can stop the daemon. One of ours that others
    may enter is closed (chmod 0700)."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(errno.ENOTDIR, f"{path} is not a directory")
    if info.st_uid != os.getuid():
        raise UnsafeDirectory(errno.EPERM, f"{path} belongs to uid {info.st_uid}, not to this user "
                                   f"(uid {os.getuid()}): refusing to put the control socket there")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)   # ours, but too open (made by hand?): close it
    return path


class DaemonSettings(Frozen, kw_only=True):
    listen: str = "tcp://127.0.0.1:5555"
    control: str = msgspec.field(default_factory=default_control)
    curve: bool = False
    keys_dir: str = DEFAULT_KEYS_DIR
    state_dir: str = msgspec.field(default_factory=default_state_dir)
    metrics_listen: str = ""
    max_request_bytes: Annotated[int, Meta(ge=1, le=1 << 30)] = 1 << 20
    drain_timeout_s: Seconds = 30.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"   # json: one object per line (dynbatchd.logs)


class RaySettings(Frozen, kw_only=True):
    """Devices on Ray actors (dynbatchd.devices.ray_pool): gpus = N actors of one GPU each, or cpus = N CPU actors."""
    address: str = "auto"
    namespace: str = "dynbatchd"
    gpus: Annotated[int, Meta(ge=0, le=4096)] = 0
    cpus: Annotated[int, Meta(ge=0, le=4096)] = 0
    cpus_per_actor: Annotated[float, Meta(ge=0, le=4096)] = 1.0

    def device_names(self) -> list[str]:
        """The engine's names of these devices (status, ``[devices] memory_gb``): ray:gpu0.. or ray:cpu0.."""
        if self.gpus:
            return [f"ray:gpu{i}" for i in range(self.gpus)]
        return [f"ray:cpu{i}" for i in range(self.cpus)]


GigaBytes = Annotated[float, Meta(ge=0, le=1 << 20)]
DEVICE_NAME = re.compile(r"^(cpu|cuda:\d+)$")   # a local device: `[devices] use`, `memory_gb`, runners' `devices`


class DeviceSettings(Frozen, kw_only=True):
    use: str | list[str] = "auto"
    ray: RaySettings | None = None
    inflight: Annotated[int, Meta(ge=1, le=8)] = 2   # one feeder's batches: a device holds workers + inflight - 1
    workers_per_device: Annotated[int, Meta(ge=1, le=16)] = 1   # worker processes (feeders) sharing each device
    queue_lead_ms: Millis = 1.0
    cpu_threads: Annotated[int, Meta(ge=0, le=4096)] = 0
    # GB of every device, or by device name ({ "cuda:0" = 80, "cuda:1" = 24 }); 0 or absent: unknown
    memory_gb: GigaBytes | dict[str, GigaBytes] = 0.0
    restart_limit: Annotated[int, Meta(ge=0, le=1_000_000)] = 5
    probe_after_s: Annotated[float, Meta(gt=0, le=MAX_S)] = 30.0   # a given-up device's first cool-down
    give_up_exit_s: Seconds = 300.0   # every device given up this long: exit 1 (0: never)
    batch_timeout_s: Seconds = 120.0

    def memory_gb_of(self, device: str) -> float:
        """The configured memory of `device` in GB (0: not configured, ask NVML)."""
        memory = self.memory_gb
        return memory.get(device, 0.0) if isinstance(memory, dict) else memory


class ModelSettings(Frozen, kw_only=True):
    runner: str
    options: dict[str, Any] = {}


class PolicySettings(Frozen, kw_only=True):
    """Which registered policy a channel uses for its window or its batch size, and its options."""
    policy: str = "fixed"
    options: dict[str, Any] = {}


class ChannelSettings(Frozen, kw_only=True):
    max_batch: Annotated[int, Meta(ge=1, le=MAX_BATCH)]
    window_ms: Millis
    deadline_ms: Annotated[float, Meta(gt=0, le=MAX_MS)] = 1000.0
    queue_limit: Annotated[int, Meta(ge=1, le=MAX_QUEUE)] = 1024
    priority: Priority = 0
    isolated: bool = False
    anonymous: Literal["refuse", "alone"] = "refuse"   # an isolated channel's requests without a tenant
    run_late: bool = False
    max_tokens: NonNegative = 0
    token_buckets: list[NonNegative] = []
    min_share: Annotated[float, Meta(ge=0, le=1)] = 0.0
    carries: list[str] = []
    window: PolicySettings | None = None
    batch_size: PolicySettings | None = None


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
    key_tenants: dict[str, str] = {}   # CURVE client key name -> the tenant its isolated requests run as
    audit_log: str = ""                # JSON lines; empty: STATE_DIR/audit.jsonl


class CacheSettings(Frozen, kw_only=True):
    entries: Annotated[int, Meta(ge=0, le=MAX_QUEUE * 16)] = 0
    max_bytes: Annotated[int, Meta(ge=0, le=1 << 44)] = 0   # 0: bounded in entries only
    policy: str = "lifecycle"
    refresh_types: list[str] = msgspec.field(default_factory=lambda: ["session_refresh"])
    rare_users: list[str] = msgspec.field(default_factory=lambda: ["rare"])
    warmup_channel: str = ""


class TopUsersSettings(Frozen, kw_only=True):
    """The top-users sketch (`dynbatchd.topusers`): how many users and inputs it keeps, how often it is saved."""
    users: Annotated[int, Meta(ge=0, le=10_000_000)] = 50_000   # 0: nothing observed, nothing saved
    inputs_per_user: Annotated[int, Meta(ge=1, le=1024)] = 4
    save_every_s: Annotated[float, Meta(ge=1, le=86_400 * 7)] = 300.0
    retain_days: Annotated[float, Meta(gt=0, le=3650)] = 30.0   # texts and users unseen this long are dropped


class HttpSettings(Frozen, kw_only=True):
    """The HTTP front door (the built-in plugin ``dynbatchd_plugins.http``): off while `listen` is empty.
    The limits bound what one client can make the door hold: inputs, requests, connections, head, time."""
    listen: str = ""
    max_inputs: Annotated[int, Meta(ge=1, le=MAX_QUEUE)] = 2048             # per request; 413 beyond
    max_requests: Annotated[int, Meta(ge=1, le=1_000_000)] = 256            # in progress at once; 429 beyond
    max_connections: Annotated[int, Meta(ge=1, le=1_000_000)] = 1024        # open at once; 429 and closed beyond
    max_headers: Annotated[int, Meta(ge=1, le=10_000)] = 100                # header lines; 431 beyond
    max_header_bytes: Annotated[int, Meta(ge=1024, le=1 << 20)] = 16_384    # a request's head; 431 beyond
    header_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 10.0          # for a request's head; 408 then
    body_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 30.0            # for its body, or its reply's sending
    keys: bool = False       # API keys required: hashes in KEYS_DIR/http/ (dynbatchctl keygen --http NAME)
    tls_cert: str = ""       # PEM certificate chain: HTTPS on the same listener (with tls_key)
    tls_key: str = ""        # PEM private key of tls_cert


Rate = Annotated[float, Meta(ge=0, le=1e9)]
InFlight = Annotated[int, Meta(ge=0, le=MAX_QUEUE * 16)]


class TenantQuota(Frozen, kw_only=True):
    """One tenant's quotas ([quotas.tenants.NAME]); a key left out takes [quotas]'s default."""
    rate: Rate | None = None
    burst: Rate | None = None
    inflight: InFlight | None = None


class QuotaSettings(Frozen, kw_only=True):
    """Per-tenant quotas (`dynbatchd.quotas`): each tenant's default, 0 being no limit, and overrides by name."""
    rate: Rate = 0.0          # requests/s per tenant (a token bucket)
    burst: Rate = 0.0         # the bucket's size; 0: one second of rate (at least 1)
    inflight: InFlight = 0    # requests admitted and not yet answered, per tenant
    tenants: dict[str, TenantQuota] = {}


class Config(Frozen, kw_only=True):
    daemon: DaemonSettings = msgspec.field(default_factory=DaemonSettings)
    devices: DeviceSettings = DeviceSettings()
    models: dict[str, ModelSettings]
    channels: dict[str, ChannelSettings]
    routing: RoutingSettings = RoutingSettings()
    compliance: ComplianceSettings = ComplianceSettings()
    cache: CacheSettings = CacheSettings()
    top_users: TopUsersSettings = TopUsersSettings()
    http: HttpSettings = HttpSettings()
    quotas: QuotaSettings = QuotaSettings()
    plugins: dict[str, dict[str, Any]] = {}
    source: str = "<memory>"

    def window_of(self, channel: str) -> PolicySettings:
        return self.channels[channel].window or PolicySettings()

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
    memory = data.get("devices", {}).get("memory_gb") if isinstance(data.get("devices"), dict) else None
    if isinstance(memory, dict):   # one device's value at a time, so that the error names the device
        for name, value in memory.items():
            _convert(value, GigaBytes, source, f"devices.memory_gb.{name}")
    cfg = _convert({**data, "source": source}, Config, source)
    _check_references(cfg)
    return cfg


def _check_ray(src: str, devices: DeviceSettings) -> None:
    ray = devices.ray
    if (ray.gpus > 0) == (ray.cpus > 0):
        raise ConfigError(src, "devices.ray",
                          "needs exactly one of gpus = N (one actor per GPU) or cpus = N (CPU actors)")
    if devices.workers_per_device != 1:
        raise ConfigError(src, "devices.workers_per_device", "must be 1 with devices.ray (one actor per device)")
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(src, "devices.ray", "needs Ray, which is not installed: pip install 'dynbatchd[ray]'")


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
    control = cfg.daemon.control
    if control.startswith("ipc://@"):
        raise ConfigError(src, "daemon.control",
                          f"{control!r} is an abstract socket, which has no file permissions: any local "
                          "user could retune or stop the daemon; use an ipc:// path")
    if not cfg.daemon.curve and control.startswith("tcp://"):
        raise ConfigError(src, "daemon.control",
                          f"{control!r} is tcp:// and CURVE is off: without authentication any user who can "
                          "connect (on loopback: any local user) could read the configuration or retune and "
                          "stop the daemon; use an ipc:// path, which its file permissions guard (or set "
                          "daemon.curve = true)")
    if not cfg.daemon.keys_dir:
        raise ConfigError(src, "daemon.keys_dir", "must name a directory")
    if cfg.http.listen and not re.match(r"^[\w.\-\[\]:]*:\d{1,5}$", cfg.http.listen):
        raise ConfigError(src, "http.listen", f"{cfg.http.listen!r} is not HOST:PORT")
    if bool(cfg.http.tls_cert) != bool(cfg.http.tls_key):
        raise ConfigError(src, "http.tls_key" if cfg.http.tls_cert else "http.tls_cert",
                          "tls_cert and tls_key go together: a certificate and its private key")
    if cfg.daemon.curve and cfg.http.listen and not cfg.http.keys:
        raise ConfigError(src, "http.keys",
                          "daemon.curve is on and the HTTP door has no API keys: it would serve clients whose "
                          "keys the daemon refuses; set http.keys = true (dynbatchctl http-key create NAME "
                          "--tenant T) or leave http.listen empty")
    if cfg.http.listen and not is_loopback_host(cfg.http.listen.rpartition(":")[0]) and not (
            cfg.http.keys and cfg.http.tls_cert):
        raise ConfigError(src, "http.listen",
                          f"{cfg.http.listen!r} is not a loopback address, and the HTTP door off loopback needs "
                          "API keys and TLS (http.keys = true, http.tls_cert and http.tls_key): else anyone who "
                          "reaches the port is served, in clear; listen on 127.0.0.1 (behind a proxy that "
                          "authenticates) or set them")
    if cfg.daemon.metrics_listen and not re.match(r"^[\w.\-\[\]:]*:\d{1,5}$", cfg.daemon.metrics_listen):
        raise ConfigError(src, "daemon.metrics_listen", f"{cfg.daemon.metrics_listen!r} is not HOST:PORT")
    if cfg.devices.ray is not None:
        _check_ray(src, cfg.devices)
    if isinstance(cfg.devices.use, str) and cfg.devices.use != "auto":
        raise ConfigError(src, "devices.use", 'must be "auto" or a list such as ["cuda:0", "cpu"]')
    if isinstance(cfg.devices.use, list):
        for i, dev in enumerate(cfg.devices.use):
            if not DEVICE_NAME.match(dev):
                raise ConfigError(src, f"devices.use[{i}]", f"{dev!r} is not a device (cpu, cuda:N)")
    if isinstance(cfg.devices.memory_gb, dict) and cfg.devices.ray is not None:
        names = cfg.devices.ray.device_names()
        for dev in cfg.devices.memory_gb:
            if dev not in names:
                raise ConfigError(src, f"devices.memory_gb.{dev}",
                                  f"{dev!r} is not one of the Ray devices ({', '.join(names) or 'none'})")
    elif isinstance(cfg.devices.memory_gb, dict):
        use = cfg.devices.use if isinstance(cfg.devices.use, list) else None
        for dev in cfg.devices.memory_gb:
            if not DEVICE_NAME.match(dev):
                raise ConfigError(src, f"devices.memory_gb.{dev}", f"{dev!r} is not a device (cpu, cuda:N)")
            if use is not None and dev not in use:
                raise ConfigError(src, f"devices.memory_gb.{dev}",
                                  f"{dev!r} is not one of the devices in devices.use ({', '.join(use)})")


def is_loopback_host(host: str) -> bool:
    """True for a loopback host of HOST:PORT (``127.*``, ``[::1]``, ``localhost``); a wildcard
    (``*``, ``0.0.0.0``, empty), an interface name or any other address is not."""
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


# -- CURVE key files ---------------------------------------------------------------
# pyzmq's certificate format (what zmq.auth.load_certificate reads and zmq.auth's
# configure_curve looks for): NAME.key holds a public key, NAME.key_secret the pair.
# The daemon's own pair is KEYS_DIR/server.key_secret (server.key is the half its clients
# need); the keys it admits are the KEYS_DIR/clients/*.key files (requests and reading the
# daemon's state) and the KEYS_DIR/admins/*.key files (all that, and changing or stopping it).

SERVER_KEY_NAME = "server"
CLIENTS_DIR = "clients"
ADMINS_DIR = "admins"
_KEY_NAME_RE = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]*$")


class KeyFileError(ValueError):
    """A key file that cannot be used; `str()` names the file and what is wrong, on one line."""


def server_secret_key_file(daemon: DaemonSettings) -> Path:
    return Path(daemon.keys_dir) / f"{SERVER_KEY_NAME}.key_secret"


def server_public_key_file(daemon: DaemonSettings) -> Path:
    return Path(daemon.keys_dir) / f"{SERVER_KEY_NAME}.key"


def client_keys_dir(daemon: DaemonSettings) -> Path:
    return Path(daemon.keys_dir) / CLIENTS_DIR


def admin_keys_dir(daemon: DaemonSettings) -> Path:
    return Path(daemon.keys_dir) / ADMINS_DIR


def writable_by_others(directory: str | os.PathLike) -> bool:
    """Its group or other users may write `directory` (OSError if it cannot be looked at):
    whoever can write a keys directory can admit a key of their own."""
    return bool(os.stat(directory).st_mode & 0o022)


def curve_endpoints(daemon: DaemonSettings) -> list[str]:
    """The addresses CURVE secures: every tcp:// one of listen and control, when curve is on.
    ipc:// sockets keep relying on file permissions."""
    return [ep for ep in (daemon.listen, daemon.control) if daemon.curve and ep.startswith("tcp://")]


def _valid_z85_key(key: bytes) -> bool:
    from zmq.utils import z85

    if len(key) != 40:
        return False
    try:
        return len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):
        return False


def read_key_file(path: str | os.PathLike, *, secret: bool = False) -> tuple[bytes, bytes | None]:
    """(public, secret or None) z85 keys of a key file; `secret`: the file must hold the secret half.

    Raises KeyFileError naming the file. A file with a secret key that other users
    may read (or that its group may write) is refused, as ssh refuses such a key.
    """
    from zmq.auth import load_certificate

    path = Path(path)
    try:
        info = path.stat()
        with path.open("rb"):
            pass
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise KeyFileError(f"{path}: not a file")
    try:
        public, secret_key = load_certificate(path)
    except (ValueError, OSError):
        raise KeyFileError(f"{path}: no public-key line: not a key file (dynbatchctl keygen writes them)") from None
    if not _valid_z85_key(public):
        raise KeyFileError(f"{path}: public-key is not a Z85 CURVE key (40 characters)")
    if secret_key is not None:
        if not _valid_z85_key(secret_key):
            raise KeyFileError(f"{path}: secret-key is not a Z85 CURVE key (40 characters)")
        if info.st_mode & 0o027:
            raise KeyFileError(f"{path}: holds a secret key but its mode is {stat.S_IMODE(info.st_mode):04o}: "
                               "other users may read it or its group change it (chmod 600)")
    elif secret:
        raise KeyFileError(f"{path}: has no secret-key: give the NAME.key_secret file, not the public NAME.key")
    return public, secret_key


def _write_new(path: Path, text: str, mode: int, force: bool) -> None:
    """Write `text` to `path` with exactly `mode` (whatever the umask), atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        if force:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)      # fails if `path` appeared meanwhile: never overwrite unasked
    finally:
        if tmp.exists():
            tmp.unlink()


def write_keypair(directory: str | os.PathLike, name: str, *, force: bool = False) -> tuple[Path, Path, str]:
    """A new CURVE key pair (zmq.curve_keypair) as DIRECTORY/NAME.key (public, mode 0644) and
    DIRECTORY/NAME.key_secret (both halves, mode 0600); returns (public file, secret file, public key).

    Refuses (FileExistsError) to replace existing files unless `force`.
    """
    import zmq

    if not _KEY_NAME_RE.match(name):
        raise ValueError(f"{name!r} is not a key name (letters, digits, '.', '_', '-')")
    directory = Path(directory)
    public_file, secret_file = directory / f"{name}.key", directory / f"{name}.key_secret"
    for existing in (public_file, secret_file):
        if existing.exists() and not force:
            raise FileExistsError(errno.EEXIST, f"{existing} exists (--force replaces it)")
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = (k.decode("ascii") for k in zmq.curve_keypair())
    curve = f'curve\n    public-key = "{public}"\n'
    _write_new(secret_file, "#   ZeroMQ CURVE **Secret** Certificate, written by dynbatchctl keygen.\n"
                            "#   DO NOT GIVE THIS FILE TO ANYONE; keep it mode 0600.\n\nmetadata\n"
                            + curve + f'    secret-key = "{secret}"\n', 0o600, force)
    _write_new(public_file, "#   ZeroMQ CURVE Public Certificate, written by dynbatchctl keygen.\n"
                            "#   Give it to the other side: a client's goes into the daemon's keys_dir/clients/\n"
                            "#   (an admin's into keys_dir/admins/),\n"
                            "#   the daemon's server.key to its clients.\n\nmetadata\n" + curve, 0o644, force)
    return public_file, secret_file, public
