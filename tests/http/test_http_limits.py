"""The HTTP front door under the daemon's limits, end to end over real HTTP: a deadline header (or
KServe parameter) that cannot be met is 504, a full queue is 429 with Retry-After (every request still answered once), and
a draining daemon is not ready (503) and answers new requests shutting_down (503, Retry-After)
while it finishes the ones it accepted."""

from __future__ import annotations

import json
import signal
import threading
import urllib.error
import urllib.request

from conftest import free_port, start_daemon
from helpers import wait_until

SLOW = """
    [models.slow]
    runner = "simulated"
    options = {{ base_ms = {base_ms} }}
    [channels.standard]
    max_batch = 1
    window_ms = 0
    deadline_ms = 60000
    queue_limit = 4
    [routing]
    default = "standard"
    [http]
    listen = "127.0.0.1:{port}"
"""


def call(url: str, body=None, headers=None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read()), {k.lower(): v for k, v in reply.headers.items()}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), {k.lower(): v for k, v in exc.headers.items()}


def in_parallel(n: int, fn) -> list:
    results: list = [None] * n

    def one(i: int) -> None:
        results[i] = fn()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_deadline_header_and_overload_statuses(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    daemon = start_daemon(tmp_path, SLOW.format(base_ms=50.0, port=port))
    try:
        status, body, _ = call(base + "/v1/embeddings", {"model": "slow", "input": "x"}, {"X-Deadline-Ms": "0.001"})
        assert (status, body["error"]["code"]) == (504, "deadline_exceeded"), body
        v2 = {"inputs": [{"name": "t", "datatype": "BYTES", "shape": [1], "data": ["x"]}],
              "parameters": {"deadline_ms": 0.001}}
        status, body, _ = call(base + "/v2/models/slow/infer", v2)   # KServe: the deadline as a parameter
        assert (status, body["code"]) == (504, "deadline_exceeded") and isinstance(body["error"], str), body
        status, body, _ = call(base + "/v2/models/nope/infer", v2)
        assert (status, body["code"]) == (404, "unknown_model") and "nope" in body["error"], body
        got = in_parallel(30, lambda: call(base + "/v1/embeddings", {"model": "slow", "input": "x"}))
        statuses = [s for s, _, _ in got]
        assert set(statuses) <= {200, 429} and statuses.count(429) > 0 and statuses.count(200) >= 4, statuses
        for status, body, headers in got:
            if status == 429:
                assert body["error"]["code"] == "overloaded" and headers.get("retry-after"), (body, headers)
        rejected = daemon.status()["channels"]["standard"]["rejected"]["overloaded"]
        assert rejected == statuses.count(429)
    finally:
        assert daemon.stop() == 0


def test_a_draining_daemon_is_not_ready_and_answers_new_requests_shutting_down(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    daemon = start_daemon(tmp_path, SLOW.format(base_ms=3000.0, port=port))
    try:
        assert call(base + "/readyz")[0] == 200
        accepted = []
        worker = threading.Thread(target=lambda: accepted.append(
            call(base + "/v1/embeddings", {"model": "slow", "input": "accepted before the stop"})))
        worker.start()
        wait_until(lambda: daemon.status()["devices"][0]["inflight"] > 0, 30,
                   message="the slow request never reached the device")
        daemon.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: call(base + "/readyz")[0] == 503, 30, message="/readyz stayed 200 while draining")
        status, body, headers = call(base + "/v1/embeddings", {"model": "slow", "input": "too late"})
        assert (status, body["error"]["code"]) == (503, "shutting_down") and headers.get("retry-after")
        assert call(base + "/healthz")[0] == 200   # alive while it drains: no restart wanted
        worker.join(60)
        assert accepted and accepted[0][0] == 200, accepted   # what it accepted is still answered
        assert daemon.proc.wait(60) == 0
    finally:
        if daemon.proc.poll() is None:
            daemon.stop()


def test_no_payload_from_an_http_request_reaches_the_log(tmp_path):
    """Every HTTP error path with a unique marker in its payload; the daemon runs at debug."""
    import uuid

    marker = "zq" + uuid.uuid4().hex
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    body = """
        [models.echo]
        runner = "callable"
        options = { target = "helpers:echo_or_fail" }
        [channels.standard]
        max_batch = 8
        window_ms = 2
        [http]
        listen = "127.0.0.1:%d"
    """ % port
    daemon = start_daemon(tmp_path, body, daemon_extra='log_level = "debug"')
    try:
        sent = [
            call(base + "/v1/embeddings", {"model": "echo", "input": [marker, "fail"]}),          # model_error
            call(base + "/v1/embeddings", {"model": marker, "input": marker}),                   # unknown_model
            call(base + "/v1/embeddings", {"model": "echo", "input": [1, marker]}),              # bad_request
            call(base + "/v2/models/echo/infer", {"inputs": [{"name": marker, "datatype": "BYTES", "shape": [9],
                                                              "data": [marker]}]}),
            call(base + "/v1/embeddings", {"model": "echo", "input": marker}, {"X-Deadline-Ms": marker}),
            call(base + "/v1/embeddings", {"model": "echo", "input": marker * 40_000}),           # over the bound
        ]
        assert [s for s, _, _ in sent] == [500, 404, 400, 400, 400, 413], sent
        raw = urllib.request.Request(base + "/v1/embeddings", data=b"{" + marker.encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(raw, timeout=30)
        except urllib.error.HTTPError as exc:
            assert exc.code == 400
    finally:
        assert daemon.stop() == 0
    log = (tmp_path / "daemon.log").read_text(errors="replace")
    assert "HTTP front door" in log, "the log is not the daemon's"
    assert marker not in log and marker[:14] not in log and marker[-14:] not in log


def test_an_http_address_in_use_stops_the_start_naming_it(tmp_path):
    import socket

    import pytest

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"http 127\.0\.0\.1:{port}: address already in use"):
            start_daemon(tmp_path, SLOW.format(base_ms=1.0, port=port), ready_timeout=60)
