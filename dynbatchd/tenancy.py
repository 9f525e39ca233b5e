"""Which tenant an isolated channel's request runs as, when CURVE (or a door's API key) says who the client is."""

from __future__ import annotations

KEY_RULE = "key-without-tenant"            # CURVE on: the client key has no tenant in [compliance] key_tenants
CLAIM_RULE = "tenant-not-of-key"           # CURVE on: the request claims a tenant its key does not belong to


def named_tenant(tenant: str | None) -> str | None:
    """`tenant`, or None when it is empty or whitespace only: a blank tenant names nobody, so on an
    isolated channel it is no tenant (rule ``isolated-needs-tenant``), never one that anonymous
    clients could share a batch under."""
    return tenant if tenant is None or tenant.strip() else None


def tenant_of_key(key_tenants: dict[str, str], key_name: str | None,
                  claimed: str | None, proven: str | None = None) -> tuple[str | None, tuple[str, str] | None]:
    """With CURVE and ``[compliance] key_tenants``, an isolated channel's tenant is the client
    key's, never the request's claim: (tenant, None), or (None, (rule, reason)) to refuse.
    `proven`: the tenant a front door's own authentication gave (an HTTP API key's), which
    stands for the CURVE key's. A blank tenant, claimed or mapped, counts as none (`named_tenant`)."""
    tenant = named_tenant(proven if proven is not None else key_tenants.get(key_name or ""))
    claimed = named_tenant(claimed)
    if tenant is None:
        return None, (KEY_RULE, f"rule {KEY_RULE}: the client key {key_name!r} is mapped to no tenant in "
                                "[compliance] key_tenants, so it may not send to an isolated channel")
    if claimed is not None and claimed != tenant:
        return None, (CLAIM_RULE, f"rule {CLAIM_RULE}: the request claims tenant {claimed!r}, but its client "
                                  f"key {key_name!r} belongs to another tenant")
    return tenant, None
