"""Per-tenant quotas: a token bucket of requests per second and a bound on requests in flight.

Admission is per channel: without quotas one tenant's burst fills a channel's queue for every
tenant. With ``[quotas]`` a tenant's requests are counted before they take queue room
(`Daemon.on_request`, for the ZeroMQ socket and the in-process doors alike): one past its rate or
its in-flight bound is answered ``quota_exceeded`` at once (HTTP 429 with Retry-After), and the
others never see it.

- ``rate`` (requests/s) refills the tenant's bucket, which holds up to ``burst`` requests (0: one
  second's worth, at least 1); each admitted request takes one. An HTTP request of n inputs is
  n requests, as it is n requests to the engine.
- ``inflight`` bounds the tenant's requests admitted and not yet answered; each answer, whatever
  its code, gives one back (`release`, called where answers are sent: `Daemon._send`).
- ``[quotas.tenants.NAME]`` overrides any of the three for one tenant; 0 is no limit.
- Requests that name no tenant share the quota of the tenant ``""`` (settable as
  ``[quotas.tenants.""]``).

The tenant is the request's: over ZeroMQ what the client claims (or, on an isolated channel with
CURVE and ``key_tenants``, its key's); over HTTP with API keys, its key's. Pure logic with an
injected clock (monotonic ns), read only while quotas are on; tests pass a fake one.
"""

from __future__ import annotations

import heapq
import math
import time
from typing import Any, Callable

NS = 1_000_000_000
MAX_IDLE_TENANTS = 100_000   # tenants remembered with nothing held; past this, idle full buckets are forgotten


class _Tenant:
    """One tenant's bucket and in-flight count, and what it was refused (the metrics' figures)."""
    __slots__ = ("rate", "burst", "inflight_limit", "tokens", "at_ns", "inflight", "refused_rate",
                 "refused_inflight", "admitted")

    def __init__(self, rate: float, burst: float, inflight_limit: int, now_ns: int):
        self.rate, self.burst, self.inflight_limit = rate, burst, inflight_limit
        self.tokens, self.at_ns, self.inflight = burst, now_ns, 0
        self.refused_rate = self.refused_inflight = self.admitted = 0

    def refill(self, now_ns: int) -> None:
        if self.rate and now_ns > self.at_ns:
            self.tokens = min(self.burst, self.tokens + self.rate * (now_ns - self.at_ns) / NS)
        self.at_ns = max(self.at_ns, now_ns)


def limits(settings: Any, tenant: str) -> tuple[float, float, int]:
    """(rate, burst, inflight) for `tenant` under ``[quotas]`` `settings`: its override, else the default."""
    override = settings.tenants.get(tenant)
    rate = settings.rate if override is None or override.rate is None else override.rate
    burst = settings.burst if override is None or override.burst is None else override.burst
    inflight = settings.inflight if override is None or override.inflight is None else override.inflight
    return rate, (burst or max(1.0, rate)), inflight


def quotas_on(settings: Any) -> bool:
    """Whether ``[quotas]`` `settings` limit anything (else a request need not be counted at all)."""
    return bool(settings.rate or settings.inflight or settings.tenants)


class Quotas:
    """The quotas of every tenant seen. `admit` before a request takes queue room, `release` at its answer."""

    def __init__(self, settings: Any = None, clock: Callable[[], int] = time.monotonic_ns):
        self.clock = clock
        self.settings: Any = None
        self.on = False
        self._tenants: dict[str, _Tenant] = {}
        self._held: dict[int, _Tenant] = {}   # id(token) -> the tenant whose in-flight count it holds
        if settings is not None:
            self.configure(settings)

    def configure(self, settings: Any) -> None:
        """Take ``[quotas]`` `settings` (at start and at each reload): counts and held requests carry over."""
        self.settings = settings
        self.on = quotas_on(settings)
        for name, state in self._tenants.items():
            rate, burst, inflight = limits(settings, name)
            state.rate, state.burst, state.inflight_limit = rate, burst, inflight
            state.tokens = min(state.tokens, burst)

    def _state(self, tenant: str, now_ns: int) -> _Tenant:
        state = self._tenants.get(tenant)
        if state is None:
            if len(self._tenants) >= MAX_IDLE_TENANTS:
                self._forget_idle(now_ns)
            state = self._tenants[tenant] = _Tenant(*limits(self.settings, tenant), now_ns)
        return state

    def _forget_idle(self, now_ns: int) -> None:
        """Forget tenants that hold nothing and whose bucket has refilled: they are as if never seen
        (their refusal counts go too; the metrics keep the top tenants only). Where that leaves the
        table over 3/4 of MAX_IDLE_TENANTS, the idle ones longest unseen go too, down to it: else,
        with buckets slower to refill than new names came, every new name swept 100,000 tenants and
        freed none (65 ms of the event loop each). Forgetting a bucket not yet full gives back its
        tokens, which a client could as well have had by naming another tenant."""
        for name, state in list(self._tenants.items()):
            state.refill(now_ns)
            if state.inflight == 0 and state.tokens >= state.burst:
                del self._tenants[name]
        keep = MAX_IDLE_TENANTS * 3 // 4
        if len(self._tenants) > keep:
            idle = sorted((state.at_ns, name) for name, state in self._tenants.items() if state.inflight == 0)
            for _, name in idle[:len(self._tenants) - keep]:
                del self._tenants[name]

    def admit(self, settings: Any, tenant: str | None, token: Any) -> str | None:
        """None if `tenant` may send one more request now (its bucket pays, and `token` holds one of
        its in-flight places until `release(token)`); else why not, naming the quota and the wait."""
        if settings is not self.settings:
            self.configure(settings)
        if not self.on:
            return None
        name, now_ns = tenant or "", self.clock()
        state = self._state(name, now_ns)
        if state.inflight_limit and state.inflight >= state.inflight_limit:
            state.refused_inflight += 1
            return (f"tenant {name!r} has {state.inflight} requests in flight, its quota ([quotas] inflight); "
                    "retry after an answer")
        if state.rate:
            state.refill(now_ns)
            if state.tokens < 1:
                state.refused_rate += 1
                return (f"tenant {name!r} is over its quota of {state.rate:g} requests/s ([quotas] rate); "
                        f"retry after {self.retry_after(tenant):.3g} s")
            state.tokens -= 1
        state.admitted += 1
        if state.inflight_limit:
            state.inflight += 1
            self._held[id(token)] = state
        return None

    @property
    def holding(self) -> bool:
        """Whether some request holds an in-flight place (else `release` has nothing to free)."""
        return bool(self._held)

    def release(self, token: Any) -> None:
        """The request `token` stood for was answered: its tenant's in-flight place is free. Idempotent."""
        if self._held:
            state = self._held.pop(id(token), None)
            if state is not None:
                state.inflight -= 1

    def retry_after(self, tenant: str | None) -> float:
        """Seconds until `tenant`'s bucket holds a request again (0: now); an in-flight refusal says 1."""
        state = self._tenants.get(tenant or "")
        if state is None:
            return 0.0
        if state.inflight_limit and state.inflight >= state.inflight_limit:
            return 1.0
        if not state.rate:
            return 0.0
        state.refill(self.clock())
        return max(0.0, (1 - state.tokens) / state.rate)

    def retry_after_header(self, tenant: str | None) -> str:
        """Retry-After's value (whole seconds, at least 1)."""
        return str(max(1, math.ceil(self.retry_after(tenant))))

    def forget(self, tenant: str) -> bool:
        """Drop `tenant`'s counts if it holds nothing in flight (e.g. erasure); True if it was known."""
        state = self._tenants.get(tenant)
        if state is None or state.inflight:
            return False
        del self._tenants[tenant]
        return True

    def snapshot(self, limit: int = 100) -> dict[str, dict[str, Any]]:
        """Per tenant seen (the `limit` most active): its limits, what it holds and what it was refused."""
        # (the top `limit` only: sorting a table of 100,000 tenants took 60 ms a status, a /metrics scrape)
        ranked = heapq.nlargest(limit, self._tenants.items(),
                                key=lambda kv: kv[1].admitted + kv[1].refused_rate + kv[1].refused_inflight)
        return {name: {"rate": s.rate, "burst": s.burst, "inflight_limit": s.inflight_limit,
                       "inflight": s.inflight, "admitted": s.admitted,
                       "refused": {"rate": s.refused_rate, "inflight": s.refused_inflight}}
                for name, s in ranked}
