"""The HTTP door's API keys and TLS, end to end: a daemon in a subprocess serving HTTPS on loopback
with a self-signed certificate made here, keys made and revoked with `dynbatchctl http-key` while
it runs. No key, a wrong key or a revoked one: 401 and nothing more; a key is its tenant's."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from typer.testing import CliRunner

from conftest import free_port, start_daemon
from dynbatchd.cli.dynbatchctl import app as ctl_app

BODY = """
    [models.enc]
    runner = "callable"
    options = { target = "helpers:embed" }
    [channels.standard]
    max_batch = 16
    window_ms = 2
    [channels.vault]
    max_batch = 8
    window_ms = 2
    isolated = true
    [routing]
    default = "standard"
    [[routing.rules]]
    tag = "banking"
    channel = "vault"
"""


def self_signed(tmp):
    """A certificate for 127.0.0.1 and its key, made with openssl (the venv has no `cryptography`)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (and the venv has no `cryptography`): cannot make a test certificate")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return cert, key


def http_key(*args):
    result = CliRunner().invoke(ctl_app, ["http-key", *args])
    assert result.exit_code == 0, result.output
    return result.stdout.strip().splitlines()[0]


def start_keyed_tls_daemon(tmp, http_extra: str = "", **options):
    """A daemon on BODY whose HTTP door needs API keys and serves HTTPS (a self-signed certificate),
    keys in `tmp`/keys; `.port`, `.http`, `.tls` (a client context trusting it), `.keys` and
    `.alice`, a key of tenant bank-a. `options`: start_daemon's."""
    cert, key = self_signed(tmp)
    keys = tmp / "keys"
    port = free_port()
    running = start_daemon(tmp, BODY + f'\n[http]\nlisten = "127.0.0.1:{port}"\nkeys = true\n{http_extra}'
                                       f'tls_cert = "{cert}"\ntls_key = "{key}"\n',
                           daemon_extra=f'keys_dir = "{keys}"', **options)
    running.port, running.http = port, f"https://127.0.0.1:{port}"
    running.tls = ssl.create_default_context(cafile=str(cert))
    running.keys = keys
    running.alice = http_key("create", "alice", "--tenant", "bank-a", "--dir", str(keys))
    return running


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    running = start_keyed_tls_daemon(tmp_path_factory.mktemp("httpkeys"))
    yield running
    running.stop()


def call(daemon, path, body=None, key=None, headers=None):
    data = json.dumps(body).encode() if body is not None else None
    head = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        head["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(daemon.http + path, data=data, headers=head)
    try:
        with urllib.request.urlopen(request, timeout=30, context=daemon.tls) as reply:
            return reply.status, json.loads(reply.read()), reply.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


EMBED = {"model": "enc", "input": "one two"}
UNAUTHORIZED = {"error": {"code": "unauthorized", "message": "unauthorized"}}


def test_a_key_is_stored_only_as_its_hash(daemon):
    text = (daemon.keys / "http" / "alice.hash").read_text()
    assert daemon.alice not in text and daemon.alice.split("_")[-1] not in text
    assert json.loads(text)["tenant"] == "bank-a"
    assert (daemon.keys / "http" / "alice.hash").stat().st_mode & 0o077 == 0


def test_no_key_or_a_wrong_key_is_401_with_no_detail(daemon):
    wrong = daemon.alice[:-4] + ("AAAA" if not daemon.alice.endswith("AAAA") else "BBBB")
    answers = [call(daemon, "/v1/embeddings", EMBED, key=k) for k in
               (None, wrong, "dbk_nobody_x", "garbage", "")]
    answers.append(call(daemon, "/v1/embeddings", EMBED, headers={"X-Api-Key": "dbk_alice_nope"}))
    for status, body, headers in answers:
        assert (status, body) == (401, UNAUTHORIZED)
        assert headers["WWW-Authenticate"] == "Bearer"
    assert call(daemon, "/v2/models/enc")[0] == 401   # metadata too
    for probe in ("/healthz", "/readyz", "/v2/health/ready"):   # probes: load balancers have no key
        assert call(daemon, probe)[0] == 200


def test_a_key_serves_as_its_tenant_and_reaches_its_isolated_channel(daemon):
    status, body, _ = call(daemon, "/v1/embeddings", EMBED, key=daemon.alice)
    assert status == 200 and body["data"][0]["embedding"] == [7.0, 2.0, 1.0]
    assert call(daemon, "/v1/embeddings", EMBED, headers={"X-Api-Key": daemon.alice})[0] == 200
    before = daemon.call("status")["channels"]["vault"]["completed"]
    status, body, _ = call(daemon, "/v1/embeddings", {**EMBED, "tags": ["banking"]}, key=daemon.alice)
    assert status == 200, body   # the isolated channel, as the key's tenant (no X-Tenant needed)
    assert daemon.call("status")["channels"]["vault"]["completed"] == before + 1
    status, body, _ = call(daemon, "/v1/embeddings", EMBED, key=daemon.alice, headers={"X-Tenant": "bank-b"})
    assert status == 403 and body["error"]["code"] == "refused"   # another tenant's name: refused


def test_keys_made_and_revoked_while_it_runs_take_effect_without_a_restart(daemon):
    bob = http_key("create", "bob", "--tenant", "shop", "--channels", "standard", "--dir", str(daemon.keys))
    assert call(daemon, "/v1/embeddings", EMBED, key=bob)[0] == 200
    status, body, _ = call(daemon, "/v1/embeddings", {**EMBED, "tags": ["banking"]}, key=bob)
    assert status == 403 and "channel" in body["error"]["message"]   # not one of its channels
    listed = CliRunner().invoke(ctl_app, ["http-key", "list", "--dir", str(daemon.keys), "--json"])
    assert {r["name"]: r["tenant"] for r in json.loads(listed.stdout)} == {"alice": "bank-a", "bob": "shop"}
    assert bob not in listed.stdout
    assert http_key("revoke", "bob", "--dir", str(daemon.keys)) == "revoked bob"
    assert call(daemon, "/v1/embeddings", EMBED, key=bob)[:2] == (401, UNAUTHORIZED)
    replaced = http_key("create", "bob", "--tenant", "shop", "--dir", str(daemon.keys))
    assert call(daemon, "/v1/embeddings", EMBED, key=replaced)[0] == 200
    assert call(daemon, "/v1/embeddings", EMBED, key=bob)[0] == 401   # the old one stays refused


def test_a_flood_of_bad_keys_is_refused_and_a_good_key_still_served(daemon):
    def bad(i):
        return call(daemon, "/v1/embeddings", EMBED, key=f"dbk_alice_{i:040d}")[0]
    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(bad, range(400)))
    assert statuses == [401] * 400
    assert call(daemon, "/v1/embeddings", EMBED, key=daemon.alice)[0] == 200
    log = daemon.logs()
    assert "dbk_alice_0000" not in log and daemon.alice not in log   # keys are never logged


def test_plain_http_is_not_served_on_the_tls_listener(daemon):
    plain = daemon.http.replace("https://", "http://")
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(urllib.request.Request(plain + "/healthz"), timeout=10).read()
    assert call(daemon, "/healthz")[0] == 200   # and the listener still serves TLS after it
