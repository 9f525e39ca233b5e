"""Answers per tenant and per model on /metrics, with bounded cardinality: the busiest tenants by
name, the rest as (other)."""

from __future__ import annotations

import random
import re
import subprocess
from collections import Counter

import pytest

from dynbatchd import metrics
from dynbatchd.client import Client, DynbatchdError
from dynbatchd.tenantmetrics import NONE, OTHER, TOP_TENANTS, UNKNOWN, TenantAnswers
from conftest import SIMULATED, start_daemon
from test_metrics import PROMTOOL, status as base_status

CODES = ("ok", "overloaded", "quota_exceeded", "deadline_exceeded")


def totals(answers: TenantAnswers) -> Counter:
    out: Counter = Counter()
    for _, model, code, n in answers.snapshot()["answers"]:
        out[(model, code)] += n
    return out


def test_a_thousand_tenants_make_at_most_top_plus_other_series_and_the_busiest_are_named():
    answers = TenantAnswers(models=["m1", "m2"])
    rng = random.Random(3)
    weights = [1.0 / (rank ** 1.2) for rank in range(1, 1001)]
    sent: Counter = Counter()
    for i in rng.choices(range(1000), weights=weights, k=50_000):
        code, model = rng.choice(CODES), rng.choice(("m1", "m2"))
        answers.count(f"tenant-{i}", model, code)
        sent[(model, code)] += 1
    rows = answers.snapshot()["answers"]
    tenants = {t for t, _, _, _ in rows}
    assert len(tenants) <= TOP_TENANTS + 1 and OTHER in tenants
    assert len(rows) <= (TOP_TENANTS + 1) * 2 * len(CODES)
    assert {f"tenant-{i}" for i in range(10)} <= tenants      # the ten busiest have series of their own
    assert totals(answers) == sent                             # every answer counted once, named or other


def test_other_only_grows_when_a_busier_tenant_displaces_a_named_one():
    answers = TenantAnswers(top=2)
    for t in ("a", "b"):
        answers.count(t, "m", "ok")
    before = dict(((t, m, c), n) for t, m, c, n in answers.snapshot()["answers"])
    for _ in range(2):
        answers.count("c", "m", "quota_exceeded")     # not yet twice the least busy named tenant's requests
    assert {t for t, *_ in answers.snapshot()["answers"]} == {"a", "b", OTHER}
    answers.count("c", "m", "quota_exceeded")         # 3 > 2 x 1: c takes a's place
    after = {(t, m, c): n for t, m, c, n in answers.snapshot()["answers"]}
    assert set(t for t, _, _ in after) == {"b", "c", OTHER}
    assert after[(OTHER, "m", "ok")] == before[("a", "m", "ok")]              # a's counts moved into other
    assert after[(OTHER, "m", "quota_exceeded")] == 2 and after[("c", "m", "quota_exceeded")] == 1


def test_no_tenant_and_unknown_models_have_labels_of_their_own():
    answers = TenantAnswers(models=["m"])
    answers.count(None, "m", "ok")
    answers.count("t", "typo", "unknown_model")
    assert answers.snapshot()["answers"] == [[NONE, "m", "ok", 1], ["t", UNKNOWN, "unknown_model", 1]]


def test_a_tenant_named_like_a_bucket_neither_poses_as_it_nor_repeats_its_series():
    """Found by fuzzing: a client's tenant "(other)" was named beside the (other) bucket, so the page
    had two series of one label set; "(none)" was counted with requests that name no tenant."""
    answers = TenantAnswers(top=4, models=["m"])
    for tenant in (None, NONE, "a", OTHER, "b", "c", OTHER):   # b, c: past the top, into (other)
        answers.count(tenant, "m", "ok")
    rows = answers.snapshot()["answers"]
    labels = [(t, m, c) for t, m, c, _ in rows]
    assert len(labels) == len(set(labels)), rows
    assert sorted(rows) == sorted([[NONE, "m", "ok", 1], ["tenant " + NONE, "m", "ok", 1], ["a", "m", "ok", 1],
                                   ["tenant " + OTHER, "m", "ok", 2], [OTHER, "m", "ok", 2]]), rows


def page_with_tenants(n: int) -> str:
    answers = TenantAnswers(models=["sim"])
    for i in range(n):
        answers.count(f"t{i}", "sim", CODES[i % len(CODES)])
        answers.count('odd "name"\\', "sim", "ok")
    return metrics.render({**base_status(), "tenants": answers.snapshot()}, gpu={})


def test_the_page_carries_bounded_tenant_series():
    page = page_with_tenants(1000)
    series = [line for line in page.splitlines() if line.startswith("dynbatchd_tenant_requests_total{")]
    assert 0 < len(series) <= (TOP_TENANTS + 1) * len(CODES)
    assert len({re.search(r'tenant="((?:\\.|[^"\\])*)"', s).group(1) for s in series}) <= TOP_TENANTS + 1
    assert "# TYPE dynbatchd_tenant_requests_total counter" in page
    assert 'tenant="odd \\"name\\"\\\\"' in page


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package `prometheus`; .ci/run installs it)")
def test_promtool_accepts_the_tenant_family():
    check = subprocess.run([PROMTOOL, "check", "metrics"], input=page_with_tenants(1000), capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, f"promtool check metrics:\n{check.stdout}{check.stderr}"


def test_a_live_daemon_counts_answers_per_tenant_and_model(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED + """
        [quotas.tenants.greedy]
        rate = 0.001
        burst = 1
    """)
    try:
        with Client(daemon.endpoint) as client:
            client.infer("sim", "fine", tenant="greedy")
            with pytest.raises(DynbatchdError) as refused:
                client.infer("sim", "over its quota", tenant="greedy")
            assert refused.value.code == "quota_exceeded"
            client.infer("sim", "fine", tenant="modest")
            with pytest.raises(DynbatchdError):
                client.infer("nope", "x", tenant="modest")
        rows = {(t, m, c): n for t, m, c, n in daemon.status()["tenants"]["answers"]}
        assert rows == {("greedy", "sim", "ok"): 1, ("greedy", "sim", "quota_exceeded"): 1,
                        ("modest", "sim", "ok"): 1, ("modest", UNKNOWN, "unknown_model"): 1}
    finally:
        daemon.stop()


def test_answers_pending_from_the_reply_path_are_counted_in_order_at_the_next_snapshot():
    # The daemon's reply path adds to `pending` (a dict increment an answer); a snapshot, a direct
    # count or PENDING_KINDS kinds count them first, so every answer is counted once and in order.
    answers, direct = TenantAnswers(top=2), TenantAnswers(top=2)
    stream = [("a", "m", "ok"), ("b", "m", "ok"), ("a", "m", "ok"), ("c", "m", "ok")] * 3
    for kind in stream:
        answers.pending[kind] = answers.pending.get(kind, 0) + 1
    for tenant, model, code in stream[:4]:
        direct.count(tenant, model, code, 3)
    assert answers.snapshot() == direct.snapshot() and not answers.pending
    answers.pending[("c", "m", "ok")] = 7
    answers.count("a", "m", "refused")          # the pending answers first: c (10) displaces b (3)
    assert {t for t, *_ in answers.snapshot()["answers"]} == {"a", "c", OTHER}
    assert sum(n for *_, n in answers.snapshot()["answers"]) == len(stream) + 7 + 1
