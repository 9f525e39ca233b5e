"""The rules a configuration must obey across its settings (references between tables, safe
endpoints, devices); each broken rule is a ConfigError naming the key.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import re
from typing import Any, Callable, Iterable, Mapping

from dynbatchd.config.schema import DEVICE_NAME, Config, DeviceSettings
from dynbatchd.errors import ConfigError


HOST_PORT = re.compile(r"^[\w.\-\[\]:]*:(\d{1,5})$")
NAME_CHARS = 128   # a channel's or model's name: log lines, error replies and metrics labels carry it
NAME_SHOWN = 40    # of a name too long, the characters an error shows
IPC_PATH_BYTES = 107   # sockaddr_un's sun_path on Linux, less its closing NUL
TWIN_MARK = "~"    # reserved: the engine names a canary's twin channel NAME~canary (tuning.canary.CANARY_SUFFIX)


def host_port_problem(listen: str) -> str | None:
    """Why `listen` is not a TCP HOST:PORT to listen on (the port 1 to 65535), or None."""
    match = HOST_PORT.match(listen)
    if not match:
        return f"{listen!r} is not HOST:PORT"
    if not 1 <= int(match.group(1)) <= 65535:
        return f"{listen!r}: the port must be 1 to 65535"
    return None


def channels_carrying(channels: Mapping[str, Any], tag: str, routes: Iterable[Any] = (),
                      spelt: Callable[[str], str] = str) -> set[str]:
    """The channels that carry `tag` traffic: those whose ``carries`` names it, and those a route
    with that `tag` sends requests to, every tag compared as `spelt` spells it (the compliance
    plugin ignores case and surrounding spaces). `routes`: anything with ``tag`` and ``channel``
    attributes, such as the routing plugin's rules (`dynbatchd_plugins.routing_config.routing_rules`),
    which the core does not read itself. The compliance plugin asks it of its regulated tags."""
    key = spelt(tag)
    named = {name for name, channel in channels.items() if any(spelt(t) == key for t in channel.carries)}
    return named | {route.channel for route in routes if route.tag is not None and spelt(route.tag) == key}


def shortened(name: str, keep: int = NAME_SHOWN) -> str:
    """`name` as an error shows it: whole if short, else its first `keep` characters and its length,
    so that a name of megabytes does not make a log line or a reply of megabytes."""
    return name if len(name) <= keep else f"{name[:keep]}...({len(name)} characters)"


def _name_problem(section: str, name: str) -> str | None:
    """Why `name` cannot name an entry of [channels] or [models] (`section`), or None."""
    if len(name) > NAME_CHARS:
        return f"a name of at most {NAME_CHARS} characters, got {len(name)}"
    if section == "channels" and TWIN_MARK in name:
        return (f"a channel name may not contain {TWIN_MARK!r}: the daemon reserves it for a canary's "
                f"twin channel (NAME{TWIN_MARK}canary)")
    return None


def check_names(source: str, section: str, names: Iterable[str]) -> None:
    """The names of [channels] or [models] (`section`): bounded, and no channel named like a
    canary's twin. Callable on a file's raw tables too, before their entries are converted."""
    for name in names:
        if problem := _name_problem(section, name):
            raise ConfigError(source, f"{section}.{shortened(name)}", problem)


def _check_ray(src: str, devices: DeviceSettings) -> None:
    ray = devices.ray
    if (ray.gpus > 0) == (ray.cpus > 0):
        raise ConfigError(src, "devices.ray",
                          "needs exactly one of gpus = N (one actor per GPU) or cpus = N (CPU actors)")
    if devices.workers_per_device != 1:
        raise ConfigError(src, "devices.workers_per_device", "must be 1 with devices.ray (one actor per device)")
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(src, "devices.ray", "needs Ray, which is not installed: pip install 'dynbatchd[ray]'")


def _check_generation_targets(cfg: Config, name: str) -> None:
    """ttft_ms / tpot_ms: targets of generated tokens, so only where some model generates them, and
    within the channel's deadline (a first token due after the deadline could never count as met)."""
    ch = cfg.channels[name]
    for key in ("ttft_ms", "tpot_ms"):
        value = getattr(ch, key)
        if value is None:
            continue
        if not any(m.runner == "causal-lm" for m in cfg.models.values()):
            raise ConfigError(cfg.source, f"channels.{name}.{key}",
                              "is a target of generated tokens, and no model has runner = \"causal-lm\"")
        if value > ch.deadline_ms:
            raise ConfigError(cfg.source, f"channels.{name}.{key}",
                              f"{key} {value:g} ms exceeds the channel deadline {ch.deadline_ms:g} ms")


def check_references(cfg: Config) -> None:
    src = cfg.source
    check_names(src, "models", cfg.models)
    check_names(src, "channels", cfg.channels)
    if not cfg.channels:
        raise ConfigError(src, "channels", "at least one channel is required")
    if not cfg.models:
        raise ConfigError(src, "models", "at least one model is required")
    if cfg.routing.default not in cfg.channels:
        raise ConfigError(src, "routing.default", f"names unknown channel {shortened(cfg.routing.default)!r}")
    if cfg.cache.warmup_channel and cfg.cache.warmup_channel not in cfg.channels:
        raise ConfigError(src, "cache.warmup_channel", f"names unknown channel {shortened(cfg.cache.warmup_channel)!r}")
    for name, ch in cfg.channels.items():
        if ch.window_ms > ch.deadline_ms:
            raise ConfigError(src, f"channels.{name}.window_ms",
                              f"window {ch.window_ms:g} ms exceeds the channel deadline {ch.deadline_ms:g} ms")
        if ch.token_buckets != sorted(set(ch.token_buckets)):
            raise ConfigError(src, f"channels.{name}.token_buckets", "must be strictly increasing token counts")
        _check_generation_targets(cfg, name)
    for ep_key in ("listen", "control"):
        ep = getattr(cfg.daemon, ep_key)
        if not re.match(r"^(tcp|ipc|inproc)://.+", ep):
            raise ConfigError(src, f"daemon.{ep_key}", f"{ep!r} is not a ZeroMQ endpoint (tcp://, ipc://)")
        if ep.startswith("ipc://") and len(ep[len("ipc://"):].encode()) > IPC_PATH_BYTES:
            raise ConfigError(src, f"daemon.{ep_key}",
                              f"an ipc:// path is at most {IPC_PATH_BYTES} bytes (the limit of a Unix socket's "
                              f"name), not {len(ep[len('ipc://'):].encode())}: binding it fails with 'file name too long'")
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
    if cfg.daemon.metrics_listen and (problem := host_port_problem(cfg.daemon.metrics_listen)):
        raise ConfigError(src, "daemon.metrics_listen", problem)
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
    (``*``, ``0.0.0.0``, empty), an interface name or any other address is not. (The HTTP
    plugin's rules for ``[http] listen`` ask it: `dynbatchd_plugins.http_config`.)"""
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

