"""Per-tenant quotas (dynbatchd.quotas) on a fake clock: the token bucket, the in-flight bound,
per-tenant overrides, reload, and the bound on tenants remembered."""

from __future__ import annotations

import pytest

from dynbatchd import config as cfgmod, quotas as Q
from dynbatchd.quotas import Quotas

S = 1_000_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


def settings(**kw):
    tenants = {name: cfgmod.TenantQuota(**over) for name, over in kw.pop("tenants", {}).items()}
    return cfgmod.QuotaSettings(**kw, tenants=tenants)


def admitted(quotas, conf, tenant, n, tokens=None):
    """How many of `n` requests of `tenant` are admitted now (each holds a fresh token unless given)."""
    tokens = tokens if tokens is not None else [object() for _ in range(n)]
    return sum(quotas.admit(conf, tenant, t) is None for t in tokens[:n])


def test_off_by_default_admits_everything_and_never_reads_the_clock():
    def clock():
        raise AssertionError("the clock is read with quotas off")
    quotas, conf = Quotas(cfgmod.QuotaSettings(), clock), cfgmod.QuotaSettings()
    assert admitted(quotas, conf, "a", 10_000) == 10_000


def test_the_bucket_holds_burst_and_refills_at_rate():
    clock = Clock()
    conf = settings(rate=10, burst=5)
    quotas = Quotas(conf, clock)
    assert admitted(quotas, conf, "a", 20) == 5            # the burst, then empty
    refusal = quotas.admit(conf, "a", object())
    assert "quota of 10 requests/s" in refusal and "retry after 0.1 s" in refusal
    assert quotas.retry_after("a") == pytest.approx(0.1)
    assert quotas.retry_after_header("a") == "1"
    clock.now += S // 10                                    # 100 ms: one request's worth
    assert admitted(quotas, conf, "a", 5) == 1
    clock.now += 10 * S                                     # long idle: never more than the burst
    assert admitted(quotas, conf, "a", 20) == 5
    total = 0                                               # then a second at the rate, over time
    for _ in range(100):
        clock.now += S // 100
        total += admitted(quotas, conf, "a", 3)
    assert 9 <= total <= 10                                 # (float refills: the last may fall just short)


def test_burst_defaults_to_one_second_of_rate_and_at_least_one():
    clock = Clock()
    conf = settings(rate=4)
    assert admitted(Quotas(conf, clock), conf, "a", 10) == 4
    conf = settings(rate=0.5)
    quotas = Quotas(conf, clock)
    assert admitted(quotas, conf, "a", 10) == 1
    clock.now += S
    assert admitted(quotas, conf, "a", 10) == 0             # half a token
    assert quotas.retry_after_header("a") == "1"
    clock.now += S
    assert admitted(quotas, conf, "a", 10) == 1


def test_tenants_have_buckets_of_their_own_and_overrides_by_name():
    clock = Clock()
    conf = settings(rate=2, tenants={"big": {"rate": 100}, "capped": {"inflight": 1}})
    quotas = Quotas(conf, clock)
    assert admitted(quotas, conf, "a", 10) == 2
    assert admitted(quotas, conf, "b", 10) == 2             # a's flood costs b nothing
    assert admitted(quotas, conf, "big", 500) == 100
    assert admitted(quotas, conf, None, 10) == 2            # no tenant: the tenant ""
    assert admitted(quotas, conf, "", 10) == 0
    assert admitted(quotas, conf, "capped", 10) == 1        # rate 2 from the default, inflight 1 its own


def test_inflight_is_held_until_release_and_release_is_idempotent():
    clock = Clock()
    conf = settings(inflight=2)
    quotas = Quotas(conf, clock)
    first, second, third = object(), object(), object()
    assert quotas.admit(conf, "a", first) is None and quotas.admit(conf, "a", second) is None
    refusal = quotas.admit(conf, "a", third)
    assert "2 requests in flight" in refusal
    assert quotas.admit(conf, "b", third) is None           # another tenant's places are its own
    quotas.release(first)
    quotas.release(first)                                   # one answer, one place: twice frees nothing more
    assert quotas.admit(conf, "a", third) is None
    assert quotas.admit(conf, "a", object()) is not None
    quotas.release(object())                                # never admitted: nothing to free
    snap = quotas.snapshot()["a"]
    assert snap["inflight"] == 2 and snap["admitted"] == 3 and snap["refused"] == {"rate": 0, "inflight": 2}


def test_an_inflight_refusal_spends_no_token():
    clock = Clock()
    conf = settings(rate=1, burst=1, inflight=1)
    quotas = Quotas(conf, clock)
    held = object()
    assert quotas.admit(conf, "a", held) is None
    clock.now += S
    assert quotas.admit(conf, "a", object()) is not None    # in flight: refused, the token stays
    quotas.release(held)
    assert quotas.admit(conf, "a", object()) is None


def test_a_reload_changes_limits_and_keeps_what_is_held():
    clock = Clock()
    conf = settings(inflight=1)
    quotas = Quotas(conf, clock)
    held = object()
    assert quotas.admit(conf, "a", held) is None
    new = settings(inflight=2, rate=1, burst=1)
    assert quotas.admit(new, "a", object()) is None         # a new settings object: taken at once
    assert quotas.admit(new, "a", object()) is not None
    quotas.release(held)
    assert quotas.snapshot()["a"]["inflight"] == 1
    off = cfgmod.QuotaSettings()
    assert admitted(quotas, off, "a", 100) == 100


def test_tenants_remembered_are_bounded(monkeypatch):
    monkeypatch.setattr(Q, "MAX_IDLE_TENANTS", 100)
    clock = Clock()
    conf = settings(rate=1000)
    quotas = Quotas(conf, clock)
    for i in range(1000):
        clock.now += S
        assert quotas.admit(conf, f"t{i}", object()) is None
    assert len(quotas.snapshot()) <= 101


def test_tenants_are_bounded_when_no_bucket_refills_between_new_names(monkeypatch):
    """Found by fuzzing: at a rate below a request a second, no bucket had refilled by the next
    new name, so each new name swept the whole table and freed nothing (65 ms each at 100,000)."""
    monkeypatch.setattr(Q, "MAX_IDLE_TENANTS", 100)
    clock = Clock()
    conf = settings(rate=0.001, inflight=5)
    quotas = Quotas(conf, clock)
    sweeps = 0
    sweep = quotas._forget_idle

    def counted(now_ns):
        nonlocal sweeps
        sweeps += 1
        sweep(now_ns)

    quotas._forget_idle = counted
    held = quotas.admit(conf, "holder", "its token")   # a tenant holding a request is never forgotten
    assert held is None
    for i in range(1000):
        clock.now += 1_000_000   # 1 ms: no bucket refills
        token = object()
        assert quotas.admit(conf, f"t{i}", token) is None
        quotas.release(token)
    assert len(quotas.snapshot()) <= 101
    assert sweeps <= 1000 // 25, sweeps   # each sweep frees a quarter of the table: not one per new name
    assert "holder" in quotas._tenants


def test_holding_says_whether_any_answer_has_a_place_to_give_back():
    clock = Clock()
    off, on = settings(), settings(inflight=1)
    assert not Q.quotas_on(off) and Q.quotas_on(on) and Q.quotas_on(settings(tenants={"a": {"rate": 1.0}}))
    quotas = Quotas(on, clock)
    assert not quotas.holding
    token = object()
    assert quotas.admit(on, "a", token) is None
    assert quotas.holding                   # the daemon's reply path releases only while this is true
    quotas.release(token)
    assert not quotas.holding
