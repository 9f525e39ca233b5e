"""The HTTP front door end to end: a daemon in a subprocess, real HTTP on loopback (urllib), the
OpenAI embeddings and KServe v2 protocols, probes, error statuses, the deadline and tag headers."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from conftest import free_port, start_daemon

BODY = """
    [models.enc]
    runner = "callable"
    options = { target = "helpers:embed" }
    [models.echo]
    runner = "callable"
    options = { target = "helpers:echo_or_fail" }
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


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    port = free_port()
    running = start_daemon(tmp_path_factory.mktemp("http"), BODY + f'\n[http]\nlisten = "127.0.0.1:{port}"\n')
    running.http = f"http://127.0.0.1:{port}"
    yield running
    running.stop()


def call(daemon, path: str, body=None, headers=None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(daemon.http + path, data=data, headers={"Content-Type": "application/json",
                                                                             **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read()), dict(reply.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def test_openai_embeddings(daemon):
    status, body, _ = call(daemon, "/v1/embeddings", {"model": "enc", "input": ["one two", "three"]})
    assert status == 200, body
    assert body["object"] == "list" and body["model"] == "enc"
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert body["data"][0]["embedding"] == [7.0, 2.0, 1.0] and body["data"][1]["embedding"] == [5.0, 1.0, 1.0]
    assert body["usage"]["prompt_tokens"] > 0
    status, body, _ = call(daemon, "/v1/embeddings", {"model": "enc", "input": "a single string"})
    assert status == 200 and len(body["data"]) == 1


def test_kserve_v2_infer_metadata_and_ready(daemon):
    request = {"id": "r1", "inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": ["ab", "c d e"]}]}
    status, body, _ = call(daemon, "/v2/models/enc/infer", request)
    assert status == 200, body
    [out] = body["outputs"]
    assert out["datatype"] == "FP32" and out["shape"] == [2, 3] and out["data"] == [2, 1, 1, 5, 3, 1]
    assert body["model_name"] == "enc" and body["id"] == "r1"
    status, meta, _ = call(daemon, "/v2/models/enc")
    assert status == 200 and meta["name"] == "enc" and meta["platform"] == "dynbatchd/callable"
    assert call(daemon, "/v2/models/enc/ready")[:2] == (200, {"name": "enc", "ready": True})
    assert call(daemon, "/v2/models/nope/ready")[0] == 404


def test_probes(daemon):
    for path in ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"):
        status, body, _ = call(daemon, path)
        assert status == 200 and body["state"] == "serving", path


@pytest.mark.parametrize("body, headers, status, code", [
    ({"model": "nope", "input": "x"}, {}, 404, "unknown_model"),
    ({"model": "enc"}, {}, 400, "bad_request"),
    ({"model": "echo", "input": "fail"}, {}, 500, "model_error"),
    ({"model": "enc", "input": "x"}, {"X-Deadline-Ms": "soon"}, 400, "bad_request"),
    ({"model": "enc", "input": "x"}, {"X-Tags": "banking"}, 403, "refused"),   # isolated channel, no tenant
    ({"model": "enc", "input": "x", "tags": ["banking"]}, {}, 403, "refused"),  # the tags in the body
    ({"model": "enc", "input": "x", "tags": "banking"}, {}, 400, "bad_request"),
    ({"model": "enc", "input": "x" * (2 << 20)}, {}, 413, "bad_request"),      # past max_request_bytes
])
def test_every_error_is_an_http_status_with_its_code(daemon, body, headers, status, code):
    got, reply, _ = call(daemon, "/v1/embeddings", body, headers)
    assert got == status and reply["error"]["code"] == code, reply


def test_tags_and_tenant_headers_route_and_deadline_header_is_the_deadline(daemon):
    status, _, _ = call(daemon, "/v1/embeddings", {"model": "enc", "input": "ledger"},
                        {"X-Tags": "banking", "X-Tenant": "bank-a", "X-Deadline-Ms": "5000"})
    assert status == 200
    assert daemon.call("status")["channels"]["vault"]["completed"] >= 1
    status, reply, _ = call(daemon, "/v1/embeddings", {"model": "enc", "input": "x"}, {"X-Deadline-Ms": "0"})
    assert status == 400 and "deadline_ms" in reply["error"]["message"]


def test_kserve_parameters_carry_tags_and_the_deadline(daemon):
    tensor = {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["ledger"]}
    status, body, _ = call(daemon, "/v2/models/enc/infer", {"inputs": [tensor], "parameters": {"tags": ["banking"]}})
    assert (status, body["code"]) == (403, "refused"), body   # routed to the isolated channel, no tenant
    status, body, _ = call(daemon, "/v2/models/enc/infer", {"inputs": [tensor], "parameters": {"tags": ["banking"]}},
                           {"X-Tenant": "bank-b"})
    assert status == 200, body
