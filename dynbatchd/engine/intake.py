"""The engine's one front door: a request's metadata in, a Job or an immediate refusal out.

The daemon (ZeroMQ and the HTTP door alike), warmup and the simulator all hand the same
`RequestMeta` to `Intake.admit`, so routing, CURVE/HTTP-key tenancy, the compliance hooks,
the quota, the cache key and rule and the deadline default are decided in one place, and
the simulator decides them exactly as the daemon does. Sans-I/O: the plugin calls and the
quota are injected; nothing here reads a clock or a socket.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Container, Mapping, NamedTuple

import msgspec

from dynbatchd import protocol as P
from dynbatchd.engine.records import Job
from dynbatchd.hookspecs import RequestInfo
from dynbatchd.tenancy import named_tenant, tenant_of_key

ADMISSION_RULE = "admission-check"   # a plugin's dynbatchd_admit refused it (its reason says which)


class RequestMeta(msgspec.Struct, frozen=True, gc=False):
    """What the intake knows of one request: never the payload. `tenant`: the request's claim;
    `key_tenant`: the tenant an HTTP API key proved; `peer`: the CURVE key's name (None: no key,
    e.g. a front door); `channel`: set by a caller that names its channel (a simulated arrival),
    which skips routing; `deadline_ms` None or 0: the channel's deadline; `allowed_channels`: where
    an HTTP API key may send (empty: anywhere), checked against the channel routing picks."""
    model: str
    tokens: int = 0
    tags: tuple[str, ...] = ()
    request_type: str | None = None
    user_frequency: str | None = None
    priority: int | None = None
    tenant: str | None = None
    key_tenant: str | None = None
    peer: str | None = None
    user: str | None = None
    text: str | None = None
    deadline_ms: float | None = None
    channel: str | None = None
    allowed_channels: tuple[str, ...] = ()


class Refusal(NamedTuple):
    """An immediate answer instead of a Job. `rule` set: a compliance refusal, audited;
    `channel`: where it was routed (None: refused before routing); `tenant`: as decided so far."""
    code: str
    message: str
    rule: str | None = None
    channel: str | None = None
    tenant: str | None = None


class Intake:
    """Decides, for each request, a Job for `Engine.submit` or a Refusal (see the module docstring).

    `config`: anything with ``routing``, ``channels``, ``compliance`` and ``models`` (None: any
    model); replace it after a reload. `route`/`admit_check`: the routing and admission hooks
    (``Plugins.channel_for``/``Plugins.admit``; `admit_check` None: no admission plugin).
    `cache_on`: the result cache is there (requests with a text get a cache key); `cache_rule`: the
    cache policy. `quota(tenant, payload)`: a refusal message or None; `quota_on(config)`: whether
    `config` sets any quota (None: always ask `quota`), decided once per config. `observe_user`: the top-users
    sketch's ``observe``. `loading(model)`: the model is not loaded yet (a str: why, the refusal's
    message: it is loading, or failed to). `curve`: the front end authenticates keys, so an
    isolated channel's tenant comes from the key. `sequence_caps(models)`: model -> the most tokens
    of one request it reads (``Plugins.sequence_caps``), decided once per config: a Job counts no
    more (its cost, its memory), while routing sees the request's own count.
    """

    def __init__(self, config: Any, route: Callable[[RequestInfo, Any], str], *,
                 admit_check: Callable[[RequestInfo, str, Any], str | None] | None = None,
                 cache_on: bool = False, cache_rule: Callable[[RequestInfo], Any] | None = None,
                 quota: Callable[[str | None, Any], str | None] | None = None,
                 quota_on: Callable[[Any], bool] | None = None,
                 observe_user: Callable[[str | None, str, str, str], None] | None = None,
                 loading: Container[str] | Callable[[str], bool | str | None] = (), curve: bool = False,
                 sequence_caps: Callable[[Any], Mapping[str, int]] | None = None):
        self.cache_on, self.cache_rule, self.quota, self.observe_user = cache_on, cache_rule, quota, observe_user
        self.quota_on, self.sequence_caps = quota_on, sequence_caps
        self.config, self.route, self.admit_check = config, route, admit_check   # (the setter below)
        self.loading = loading if callable(loading) else loading.__contains__
        self.curve = curve

    @property
    def config(self) -> Any:
        return self._config

    @config.setter
    def config(self, config: Any) -> None:
        """A new config (a reload): what `admit` reads of it per request is looked up here, once."""
        self._config = config
        self._models = getattr(config, "models", None)
        self._channels = config.channels
        self._key_tenants = config.compliance.key_tenants
        self._quota = self.quota if self.quota_on is None or self.quota_on(config) else None
        caps = self.sequence_caps
        self._caps = caps(self._models) if caps is not None and self._models else {}

    @classmethod
    def from_plugins(cls, config: Any, plugins: Any, **kwargs: Any) -> "Intake":
        """The intake with `plugins`' routing and admission hooks (what the daemon and the simulator use)."""
        return cls(config, plugins.channel_for, admit_check=plugins.admit if plugins.has_admission_checks else None,
                   sequence_caps=plugins.sequence_caps, **kwargs)

    def admit(self, meta: RequestMeta, payload: Any = None) -> Job | Refusal:
        """A Job to submit, or why not (in the daemon's order: model, routing and the API key's
        channels, tenancy, compliance, quota)."""
        model, models = meta.model, self._models
        if models is not None and model not in models:
            return Refusal(P.UNKNOWN_MODEL, f"no model named {model!r}")
        if unready := self.loading(model):   # a str says why: loading, or failed to load
            why = unready if isinstance(unready, str) else f"model {model!r} is still loading"
            return Refusal(P.UNKNOWN_MODEL, why)
        config, tenant = self._config, meta.tenant
        info = RequestInfo(model, meta.tags, meta.request_type, meta.user_frequency, meta.tokens,
                           meta.priority, tenant, meta.user)
        channel = meta.channel or self.route(info, config)
        if meta.allowed_channels and channel not in meta.allowed_channels:
            return Refusal(P.REFUSED, f"this API key may not send to channel {channel!r}", None, channel, tenant)
        settings = self._channels[channel]
        if settings.isolated and tenant is not None and named_tenant(tenant) is None:
            tenant = None   # blank: no tenant, so the engine refuses it (or runs it alone), never shares a batch
            info = msgspec.structs.replace(info, tenant=None)
        key_tenants = self._key_tenants
        if key_tenants and self.curve and settings.isolated:
            tenant, refusal = tenant_of_key(key_tenants, meta.peer, meta.tenant, meta.key_tenant)
            if refusal:
                return Refusal(P.REFUSED, refusal[1], refusal[0], channel, meta.tenant)
            info = msgspec.structs.replace(info, tenant=tenant)
        if self.admit_check is not None and (reason := self.admit_check(info, channel, config)):
            return Refusal(P.REFUSED, reason, ADMISSION_RULE, channel, tenant)
        if self._quota is not None and (refusal := self._quota(tenant, payload)):
            return Refusal(P.QUOTA_EXCEEDED, refusal, None, channel, tenant)
        cache_key = rule = None
        if meta.text is not None:
            if self.cache_on:
                cache_key = cache_key_of(model, tenant, meta.text)
            if self.cache_rule is not None:
                rule = self.cache_rule(info)
            if meta.user is not None and self.observe_user is not None and not settings.isolated:
                self.observe_user(tenant, meta.user, model, meta.text)
        tokens, cap = meta.tokens, self._caps.get(model)
        if cap is not None and tokens > cap:   # the model reads the first `cap`: a 40 KB text costs what 256 tokens do
            tokens = cap
        return Job(model, channel, tokens, meta.deadline_ms or settings.deadline_ms,
                   payload, tenant, cache_key, rule)


def cache_key_of(model: str, tenant: str | None, text: str) -> tuple:
    """The result cache's key: a tenant never sees another's results (warmup keys its inputs so too)."""
    return (model, tenant, text)


def sim_config(channels: Any, routing: Mapping[str, Any] | None = None) -> Any:
    """A config for the intake of a simulator given only channels and a ``[routing]`` table as a file
    spells it: ``{"default": ..., "rules": [...]}``, the core's default and the keys the routing
    plugin owns (`dynbatchd.config.shared`; a Config's own: ``table_of(config, "routing")``); None:
    the first channel, no rules. Any model, no key tenants, the compliance plugin's defaults."""
    from dynbatchd.config import ComplianceSettings, RoutingSettings, split_table

    if routing is not None and not isinstance(routing, Mapping):   # a RoutingSettings would lose the rules
        raise TypeError(f"routing: the [routing] table as a mapping (dynbatchd.config.table_of(config, 'routing')), "
                        f"not {type(routing).__name__}")
    core, owned = split_table("routing", {"default": next(iter(channels)), **(routing or {})})
    return SimpleNamespace(routing=msgspec.convert(core, RoutingSettings), channels=channels,
                           compliance=ComplianceSettings(), models=None, source="<simulation>",
                           plugin_keys={"routing": owned} if owned else {})
