"""The configuration's shape: frozen, typed msgspec structs, one per TOML table, and the
bounds of every number (so no setting can overflow the scheduler's nanosecond arithmetic).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from dynbatchd.config.paths import DEFAULT_KEYS_DIR, default_control, default_state_dir

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
Target = Annotated[float, Meta(gt=0, le=MAX_MS)]   # a latency target: > 0 ms


class Frozen(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


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
    long_share: Annotated[float, Meta(ge=0, le=1)] = 0.9   # of FIFO's on-time longest tenth, kept for them (0: off)
    carries: list[str] = []
    window: PolicySettings | None = None
    batch_size: PolicySettings | None = None
    # generative (causal-lm) requests: time-to-first-token and time-per-output-token targets
    ttft_ms: Target | None = None
    tpot_ms: Target | None = None


# [routing], [compliance] and [cache] are shared tables: the structs below are the core's keys; any
# other key of these tables is a plugin's, set aside at parse into Config.plugin_keys and checked by
# the plugin whose config-table struct claims the table (dynbatchd.config.shared). The built-ins:
# the routing plugin owns [routing] rules, the compliance plugin [compliance] regulated_tags and
# banking_max_window_ms, the cache plugin's lifecycle policy [cache] refresh_types and rare_users.

class RoutingSettings(Frozen, kw_only=True):
    default: str = "standard"


class ComplianceSettings(Frozen, kw_only=True):
    key_tenants: dict[str, str] = {}   # CURVE client key name -> the tenant its isolated requests run as
    audit_log: str = ""                # JSON lines; empty: STATE_DIR/audit.jsonl


class CacheSettings(Frozen, kw_only=True):
    entries: Annotated[int, Meta(ge=0, le=MAX_QUEUE * 16)] = 0
    max_bytes: Annotated[int, Meta(ge=0, le=1 << 44)] = 0   # 0: bounded in entries only
    policy: str = "lifecycle"
    warmup_channel: str = ""


SHARED_TABLES: dict[str, type] = {"routing": RoutingSettings, "compliance": ComplianceSettings, "cache": CacheSettings}


class TopUsersSettings(Frozen, kw_only=True):
    """The top-users sketch (`dynbatchd.topusers`): how many users and inputs it keeps, how often it is saved."""
    users: Annotated[int, Meta(ge=0, le=10_000_000)] = 50_000   # 0: nothing observed, nothing saved
    inputs_per_user: Annotated[int, Meta(ge=1, le=1024)] = 4
    save_every_s: Annotated[float, Meta(ge=1, le=86_400 * 7)] = 300.0
    retain_days: Annotated[float, Meta(gt=0, le=3650)] = 30.0   # texts and users unseen this long are dropped
    max_text_bytes: Annotated[int, Meta(ge=1, le=1 << 20)] = 16 << 10          # a longer text is counted, not kept
    text_budget_bytes: Annotated[int, Meta(ge=1 << 10, le=1 << 36)] = 64 << 20   # of the texts kept, in all


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
    # [http]: the HTTP door plugin's table (dynbatchd_plugins.http_config owns its shape and rules,
    # through dynbatchd_config_tables), kept at the top level so that existing configs keep loading
    http: dict[str, Any] = {}
    quotas: QuotaSettings = QuotaSettings()
    plugins: dict[str, dict[str, Any]] = {}
    # the keys of [routing], [compliance] and [cache] that plugins own (SHARED_TABLES), by table:
    # set by parse, not spelled in a file; to_dict puts them back in their tables
    plugin_keys: dict[str, dict[str, Any]] = {}
    source: str = "<memory>"

    def window_of(self, channel: str) -> PolicySettings:
        return self.channels[channel].window or PolicySettings()
