"""Answers per tenant and per model, by code, with bounded cardinality: the busiest tenants by
name, everyone else as one "(other)".

An SRE asks "who is being refused?": a counter per (tenant, model, code) answers it, but a
label per tenant would give Prometheus one series per tenant ever seen. So only the `top`
tenants with the most requests get series of their own; the rest count under the tenant
label ``(other)``, and requests that name no tenant under ``(none)``. Models outside the
configuration (answered unknown_model) count as ``(unknown)``; codes are the protocol's. A tenant
a client names ``(other)`` or ``(none)`` is labelled ``tenant (other)`` or ``tenant (none)``: else
it would pose as those buckets, and a named ``(other)`` printed a second series of that label.

Which tenants are named: the first `top` seen, then a tenant whose requests (counted in a
bounded Space-Saving sketch of `CANDIDATES` x `top` tenants) pass twice those of the least
busy named tenant takes its place. The demoted tenant's counts move into ``(other)``, so every
series stays monotonic or ends (a series that ends is what Prometheus handles), and the
factor two keeps two tenants near the boundary from trading places on every request. Pure
logic, no clock. The daemon's reply path only adds each answer to `pending` (a dict increment);
they are counted, in the order they came, at the next `snapshot` (a scrape, a status) or `count`,
or once PENDING_KINDS kinds are held: so a tenant is named, or displaced, at those points.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Mapping

TOP_TENANTS = 20        # tenants with series of their own
CANDIDATES = 8          # the sketch of candidates holds this many times TOP_TENANTS tenants
OTHER, NONE, UNKNOWN = "(other)", "(none)", "(unknown)"
RESERVED = frozenset((OTHER, NONE))   # tenant labels of the buckets, never a client's tenant's
PROMOTE_FACTOR = 2
PENDING_KINDS = 1024    # kinds of answers the reply path may hold in `pending` before they are counted


class TenantAnswers:
    def __init__(self, top: int = TOP_TENANTS, models: Iterable[str] | None = None):
        self.top = top
        self.models = set(models) if models is not None else None   # None: any model is labelled by name
        self.named: dict[str, Counter[tuple[str, str]]] = {}
        self.other: Counter[tuple[str, str]] = Counter()
        self._requests: dict[str, int] = {}   # tenant -> requests (Space-Saving: never under its true count)
        self._floor = 0
        self._bar = 0                         # a candidate past this may displace the least busy named tenant
        # (tenant, model, code) -> answers not counted yet: the daemon's reply path adds here, a dict
        # increment an answer, and they are counted at the next snapshot (or `count`, or PENDING_KINDS)
        self.pending: dict[tuple[str | None, str, str], int] = {}

    def count(self, tenant: str | None, model: str, code: str, n: int = 1) -> None:
        """`n` answers of `code` to requests of `tenant` for `model` (after those pending)."""
        self.flush()
        self.count_all({(tenant, model, code): n})

    def flush(self) -> None:
        """Count the answers `pending` holds, in the order they came."""
        if self.pending:   # (the same dict stays: the reply path may hold it while an answer is counted)
            pending = dict(self.pending)
            self.pending.clear()
            self.count_all(pending)

    def count_all(self, answers: Mapping[tuple[str | None, str, str], int]) -> None:
        """Many answers at once ((tenant, model, code) -> how many): a batch's replies are counted
        in one pass per kind, in one call (this runs on the daemon's reply path)."""
        models, requests = self.models, self._requests
        for (tenant, model, code), n in answers.items():
            name = NONE if tenant is None else tenant if tenant not in RESERVED else "tenant " + tenant
            if models is not None and model not in models:
                model = UNKNOWN
            seen = requests.get(name)
            if seen is None:
                if len(requests) >= CANDIDATES * self.top:
                    self._prune()   # (a new dict)
                    requests = self._requests
                seen = self._floor
            requests[name] = seen = seen + n
            counters = self.named.get(name)
            if counters is None and (len(self.named) < self.top or seen > self._bar):
                counters = self._promote(name, seen)
            (counters if counters is not None else self.other)[(model, code)] += n

    def _promote(self, name: str, seen: int) -> Counter[tuple[str, str]] | None:
        if len(self.named) >= self.top:
            least = min(self.named, key=lambda t: self._requests[t])
            self._bar = PROMOTE_FACTOR * self._requests[least]
            if seen <= self._bar:   # the bar was stale (the named tenants grew): not yet
                return None
            self.other.update(self.named.pop(least))
        counters = self.named[name] = Counter()
        if len(self.named) >= self.top:
            self._bar = PROMOTE_FACTOR * min(self._requests[t] for t in self.named)
        return counters

    def _prune(self) -> None:
        """Keep the busiest candidates (named tenants always); the highest count dropped is the floor."""
        ranked = sorted(self._requests.items(), key=lambda kv: (kv[0] not in self.named, -kv[1]))
        keep = CANDIDATES * self.top // 2
        for _, dropped in ranked[keep:]:
            self._floor = max(self._floor, dropped)
        self._requests = dict(ranked[:keep])

    def snapshot(self) -> dict[str, Any]:
        """For status and /metrics: {"top", "answers": [[tenant, model, code, n]...]}, named tenants
        by name and the rest as (other)."""
        self.flush()
        rows = [[t, m, c, n] for t, counters in sorted(self.named.items()) for (m, c), n in sorted(counters.items())]
        rows += [[OTHER, m, c, n] for (m, c), n in sorted(self.other.items())]
        return {"top": self.top, "answers": rows}
