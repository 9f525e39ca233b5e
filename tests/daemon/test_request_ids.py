"""Request ids end to end, on a live daemon that logs JSON (``[daemon] log_format = "json"``): a
ZeroMQ client's id and an HTTP request's ``X-Request-Id`` (or one the door makes) come back in the
reply, and name the request in the audit log and in the log lines about it, never with its content.
Last, every line the daemon and its workers wrote parses as one JSON object."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
import uuid

import msgspec
import pytest
import zmq

from conftest import free_port, start_daemon, wait_until

MARKER = "zq" + uuid.uuid4().hex   # request content: must never reach a log line

BODY = """
    [models.enc]
    runner = "callable"
    options = { target = "helpers:embed" }
    [models.echo]
    runner = "callable"
    options = { target = "helpers:echo_or_fail" }
    [channels.standard]
    max_batch = 8
    window_ms = 2
    [channels.vault]
    max_batch = 4
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
    tmp = tmp_path_factory.mktemp("ids")
    running = start_daemon(tmp, BODY + f'\n[http]\nlisten = "127.0.0.1:{port}"\n',
                           daemon_extra='log_format = "json"\nlog_level = "debug"')
    running.http = f"http://127.0.0.1:{port}"
    running.audit = tmp / "state" / "audit.jsonl"
    yield running
    if running.proc.poll() is None:
        running.stop()


def post(daemon, path: str, body, headers=None):
    request = urllib.request.Request(daemon.http + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read()), reply.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def zmq_call(daemon, request: dict) -> dict:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    try:
        sock.send(msgspec.msgpack.encode(request))
        assert sock.poll(30_000), "no reply"
        return msgspec.msgpack.decode(sock.recv_multipart()[-1])
    finally:
        sock.close()


def log_lines(daemon) -> list[dict]:
    return [json.loads(line) for line in daemon.logs().splitlines() if line.strip()]


def lines_about(daemon, request_id) -> list[dict]:
    """The log lines naming `request_id` (waiting a little for them: the log is another process's)."""
    found: list[dict] = []

    def logged() -> bool:
        found[:] = [line for line in log_lines(daemon) if line.get("request_id") == request_id]
        return bool(found)
    wait_until(logged, 10, 0.05, message=f"no log line carries request id {request_id!r}")
    return found


def audit_records(daemon, request_id) -> list[dict]:
    found: list[dict] = []

    def written() -> bool:
        text = daemon.audit.read_text() if daemon.audit.exists() else ""
        found[:] = [r for r in map(json.loads, text.splitlines()) if r.get("request_id") == request_id]
        return bool(found)
    wait_until(written, 10, 0.05, message=f"no audit record carries request id {request_id!r}")
    return found


def test_http_x_request_id_is_echoed(daemon):
    status, body, headers = post(daemon, "/v1/embeddings", {"model": "enc", "input": "hello"},
                                 {"X-Request-Id": "trace-abc-123"})
    assert status == 200, body
    assert headers["X-Request-Id"] == "trace-abc-123"
    # None given: the door makes one and says which.
    status, body, headers = post(daemon, "/v1/embeddings", {"model": "enc", "input": "hello"})
    assert status == 200 and re.fullmatch(r"[0-9a-f]{32}", headers["X-Request-Id"])
    # An error reply carries it too; a long or unprintable one is cut and cleaned, not refused.
    status, body, headers = post(daemon, "/v1/embeddings", {"model": "nope", "input": "x"},
                                 {"X-Request-Id": "e" * 300})
    assert status == 404 and headers["X-Request-Id"] == "e" * 128


def test_http_refusal_carries_the_id_to_the_audit_log_and_the_log(daemon):
    rid = "refuse-" + uuid.uuid4().hex[:8]
    status, body, headers = post(daemon, "/v1/embeddings", {"model": "echo", "input": MARKER},
                                 {"X-Request-Id": rid, "X-Tags": "banking"})   # isolated, no tenant
    assert status == 403, body
    assert headers["X-Request-Id"] == rid
    [record] = audit_records(daemon, rid)
    assert record["action"] == "refused" and record["channel"] == "vault"
    daemon_lines = [line for line in lines_about(daemon, rid) if line["logger"] == "dynbatchd"]
    assert daemon_lines and daemon_lines[0]["code"] == "refused" and daemon_lines[0]["channel"] == "vault"
    assert rid in daemon_lines[0]["message"] and daemon_lines[0]["level"] == "info"


def test_http_inputs_of_one_request_are_named_id_hash_index(daemon):
    rid = "many-" + uuid.uuid4().hex[:8]
    inputs = [{"name": "text", "datatype": "BYTES", "shape": [2], "data": [MARKER, "fail"]}]
    status, body, headers = post(daemon, "/v2/models/echo/infer", {"inputs": inputs}, {"X-Request-Id": rid})
    assert status == 500 and headers["X-Request-Id"] == rid, body
    failed = lines_about(daemon, f"{rid}#1")
    assert any(line["code"] == "model_error" and line["level"] == "warning" for line in failed), failed


def test_zeromq_client_id_in_the_reply_the_audit_log_and_the_log(daemon):
    rid = "client-" + uuid.uuid4().hex[:8]
    reply = zmq_call(daemon, {"id": rid, "model": "echo", "text": MARKER, "tags": ["banking"]})
    assert reply["id"] == rid and reply["error"]["code"] == "refused"
    assert audit_records(daemon, rid)[0]["channel"] == "vault"
    assert lines_about(daemon, rid)[0]["code"] == "refused"
    # A model error for an input: a warning naming the id, the model, the channel.
    reply = zmq_call(daemon, {"id": 4242, "model": "echo", "text": "fail"})
    assert reply["id"] == 4242 and reply["error"]["code"] == "model_error"
    [line] = lines_about(daemon, 4242)
    assert (line["level"], line["model"], line["channel"], line["code"]) == ("warning", "echo", "standard",
                                                                              "model_error")
    # An unknown model: its name is the client's text, not logged; the id is.
    reply = zmq_call(daemon, {"id": 4243, "model": MARKER, "text": MARKER})
    assert reply["error"]["code"] == "unknown_model"
    [line] = lines_about(daemon, 4243)
    assert "model" not in line and line["code"] == "unknown_model"


def test_a_client_id_is_bounded_in_the_log(daemon):
    rid = "L" * 1000
    reply = zmq_call(daemon, {"id": rid, "model": "echo", "text": "x", "tags": ["banking"]})
    assert reply["id"] == rid   # the client gets its own id back, whole
    [line] = lines_about(daemon, "L" * 160)
    assert line["code"] == "refused"


def test_every_line_is_one_json_object_and_no_payload(daemon):
    assert daemon.stop() == 0
    text = daemon.logs()
    assert MARKER not in text and MARKER[:14] not in text
    lines = text.splitlines()
    assert len(lines) > 10
    for raw in lines:
        line = json.loads(raw)   # every line, the workers' too
        assert isinstance(line, dict) and {"time", "level", "logger", "message"} <= line.keys(), raw
        assert line["time"].endswith("Z")
    assert any("worker" in json.loads(raw) for raw in lines), "no worker line: workers do not log JSON"
    assert any(json.loads(raw)["message"].startswith("serving requests") for raw in lines)
