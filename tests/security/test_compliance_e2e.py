"""Regulated traffic end to end, over real sockets: a request routed to an isolated channel without
a tenant is refused, naming the rule; the audit log, /metrics and `status --compliance` show it."""

from __future__ import annotations

import json
import urllib.request

import pytest

from conftest import REPO, free_port, start_daemon
from dynbatchd.client import Client, Refused
from dynbatchd.engine import ANONYMOUS_RULE

BODY = """
    [models.sim]
    runner = "simulated"
    options = { base_ms = 1.0, per_item_ms = 0.1 }
    [channels.standard]
    max_batch = 8
    window_ms = 1
    [channels.medical]
    max_batch = 8
    window_ms = 1
    isolated = true
    [channels.vault]
    max_batch = 8
    window_ms = 1
    isolated = true
    anonymous = "alone"
    [routing]
    default = "standard"
    [[routing.rules]]
    tag = "medical"
    channel = "medical"
    [[routing.rules]]
    tag = "banking"
    channel = "vault"
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compliance")
    port = free_port()
    running = start_daemon(tmp, BODY, daemon_extra=f'state_dir = "{tmp}/state"\nmetrics_listen = "127.0.0.1:{port}"')
    running.metrics_url = f"http://127.0.0.1:{port}/metrics"
    running.audit = tmp / "state" / "audit.jsonl"
    yield running
    running.stop()


def test_a_tenantless_request_to_an_isolated_channel_is_refused_and_audited(daemon):
    with Client(daemon.endpoint, timeout=30) as client:
        with pytest.raises(Refused) as refused:
            client.infer("sim", "chart 17", tags=["medical"])
        assert ANONYMOUS_RULE in str(refused.value) and "medical" in str(refused.value)
        # with a tenant it runs; an open channel needs none
        assert client.infer("sim", "chart 17", tags=["medical"], tenant="hospital-a") is not None
        assert client.infer("sim", "hello") is not None
    records = [json.loads(line) for line in daemon.audit.read_text().splitlines()]
    mine = [r for r in records if r["rule"] == ANONYMOUS_RULE and r["channel"] == "medical"]
    assert mine and mine[-1]["action"] == "refused" and mine[-1]["tenant"] is None
    assert set(mine[-1]) == {"time", "rule", "action", "channel", "tenant", "request_id"}
    assert "chart 17" not in daemon.audit.read_text()          # never a payload
    page = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    assert (f'dynbatchd_compliance_decisions_total{{rule="{ANONYMOUS_RULE}",action="refused"}}' in page)


def test_a_channel_that_says_alone_runs_a_tenantless_request_in_a_batch_of_one(daemon):
    with Client(daemon.endpoint, timeout=30) as client:
        futures = [client.submit("sim", f"ledger {i}", tags=["banking"]) for i in range(6)]
        results = [f.result(timeout=30) for f in futures]
    assert all(r is not None for r in results)
    status = daemon.call("status")
    assert {int(size) for size in status["channels"]["vault"]["batch_sizes"]} == {1}
    decisions = {(d["rule"], d["action"]): d["count"] for d in status["compliance"]["decisions"]}
    assert decisions[(ANONYMOUS_RULE, "ran alone")] >= 6


def test_status_compliance_summarises_the_audit(daemon):
    from typer.testing import CliRunner

    from dynbatchd.cli.dynbatchctl import app

    result = CliRunner().invoke(app, ["--control", daemon.control, "status", "--compliance", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert any(d["rule"] == ANONYMOUS_RULE and d["action"] == "refused" for d in summary["decisions"])
    assert summary["audit_log"].endswith("audit.jsonl")
    table = CliRunner().invoke(app, ["--control", daemon.control, "status", "--compliance"])
    assert table.exit_code == 0 and ANONYMOUS_RULE in table.stdout and "audit log" in table.stdout


# --- with CURVE: the tenant is the client key's -----------------------------------------------

CURVE_EXTRA = """
    [channels.medical]
    max_batch = 8
    window_ms = 1
    isolated = true
    [[routing.rules]]
    tag = "medical"
    channel = "medical"
    [compliance]
    key_tenants = { alice = "hospital-a" }
"""


def test_with_curve_an_isolated_request_runs_as_its_keys_tenant(tmp_path):
    import signal

    import zmq

    from dynbatchd import config as cfgmod
    from dynbatchd.client import CurveKeys
    from test_security_curve import Keys, start_curve_daemon

    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    keys = Keys(tmp_path)
    bob_public, bob_secret, _ = cfgmod.write_keypair(keys.mine, "bob")   # admitted, but of no tenant
    (keys.dir / "clients" / "bob.key").write_bytes(bob_public.read_bytes())
    bob = CurveKeys.load(bob_secret, keys.server_public)
    proc, endpoint, _, log = start_curve_daemon(tmp_path, keys, CURVE_EXTRA)
    try:
        with Client(endpoint, timeout=30, curve=keys.alice) as alice:
            assert alice.infer("echo", "scan 1", tags=["medical"]) == "scan 1"            # no claim: her key's
            assert alice.infer("echo", "scan 2", tags=["medical"], tenant="hospital-a") == "scan 2"
            with pytest.raises(Refused) as forged:
                alice.infer("echo", "scan 3", tags=["medical"], tenant="hospital-b")
            assert "tenant-not-of-key" in str(forged.value)
            assert alice.infer("echo", "open", tenant="anyone") == "open"                 # open channel: trusted
        with Client(endpoint, timeout=30, curve=bob) as client:
            with pytest.raises(Refused) as keyless:
                client.infer("echo", "scan 4", tags=["medical"])
            assert "key-without-tenant" in str(keyless.value)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    records = [json.loads(line) for line in (tmp_path / "state" / "audit.jsonl").read_text().splitlines()]
    assert [(r["rule"], r["tenant"]) for r in records] == [("tenant-not-of-key", "hospital-b"),
                                                          ("key-without-tenant", None)]
    assert "scan" not in (tmp_path / "state" / "audit.jsonl").read_text() and "scan 3" not in log.read_text()
