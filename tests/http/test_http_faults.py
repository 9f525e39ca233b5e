"""Faults a live fuzzing pass found in the HTTP door, end to end against a daemon in a subprocess over
real sockets:

- a KServe ``parameters.deadline_ms`` of 400 nines was a 500 (float() overflowed), ``true`` was a
  deadline of 1 ms: now anything but a number > 0 and <= one day is 400 naming the key;
- v2 numbers given as strings (``"1e400"``), bools, or values their datatype cannot hold (FP16
  beyond 65504) reached the model as infinity and were blamed on it (502): now 400 naming the input;
- requests took a ``max_requests`` slot from their head's arrival, probes included: clients
  trickling their bodies in filled the door and every probe was 429. Now a request takes a slot
  once its body is read, and probes and metadata take none.
"""

from __future__ import annotations

import json
import socket
import threading

import pytest

from conftest import free_port, start_daemon
from helpers import wait_until
from test_http_hostile import call, read_reply   # (tests/http)

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
    [channels.held]
    max_batch = 3
    window_ms = 600000
    deadline_ms = 600000
    [routing]
    default = "standard"
    [[routing.rules]]
    tag = "held"
    channel = "held"
    [http]
    listen = "127.0.0.1:%d"
    max_requests = 2
"""
TEXT = {"name": "t", "datatype": "BYTES", "shape": [1], "data": ["x"]}
PROBES = ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready", "/v2/models/enc", "/v2/models/enc/ready")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    port = free_port()
    running = start_daemon(tmp_path_factory.mktemp("faults"), BODY % port)
    running.port, running.http = port, f"http://127.0.0.1:{port}"
    yield running
    assert running.stop() == 0, running.log_tail()
    assert "Traceback" not in running.logs()


# -- 1. parameters.deadline_ms ------------------------------------------------------

@pytest.mark.parametrize("deadline", [b"9" * 400, b"true", b'"100"', b"-1", b"0", b"1e300", b"86400001"],
                         ids=["huge-int", "bool", "string", "negative", "zero", "huge-float", "past-a-day"])
def test_a_v2_deadline_that_is_not_a_positive_number_is_400_naming_it(daemon, deadline):
    raw = b'{"parameters": {"deadline_ms": ' + deadline + b'}, "inputs": [' + json.dumps(TEXT).encode() + b"]}"
    status, reply = call(daemon, "/v2/models/enc/infer", raw=raw)
    assert (status, reply["code"]) == (400, "bad_request"), reply
    assert "parameters.deadline_ms" in reply["error"], reply


def test_a_v2_deadline_in_range_is_served_and_parameters_must_be_an_object(daemon):
    for deadline in (5000, 86_400_000, 2.5e4, None):   # null: no deadline
        body = {"parameters": {"deadline_ms": deadline}, "inputs": [TEXT]}
        status, reply = call(daemon, "/v2/models/enc/infer", body)
        assert status == 200, (deadline, reply)
    status, reply = call(daemon, "/v2/models/enc/infer", {"parameters": [1], "inputs": [TEXT]})
    assert (status, reply["code"]) == (400, "bad_request") and "parameters" in reply["error"], reply


# -- 2. v2 numbers --------------------------------------------------------------------

@pytest.mark.parametrize("datatype, data, rule", [
    ("FP32", ["1e400"], "must be numbers"),
    ("FP32", ["1.5"], "must be numbers"),
    ("FP32", [True], "must be numbers"),
    ("FP64", [[1.0], ["2"]], "must be numbers"),   # nested: every value is checked
    ("INT64", [1.5], "must be integers"),
    ("INT32", [False], "must be integers"),
    ("BOOL", ["true"], "true or false"),
    ("BOOL", [1], "true or false"),
    ("FP16", [1e6], "out of the range of FP16"),
    ("FP32", [1e39], "out of the range of FP32"),
    ("FP32", [10 ** 39], "out of the range of FP32"),
    ("FP64", [10 ** 400], "out of the range of FP64"),
    ("UINT8", [-1], "out of the range of UINT8"),
    ("INT32", [2 ** 31], "out of the range of INT32"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 12 else None)
def test_v2_numbers_the_datatype_cannot_hold_are_400_naming_the_input(daemon, datatype, data, rule):
    tensor = {"name": "feature", "datatype": datatype, "shape": [len(data)], "data": data}
    if isinstance(data[0], list):
        tensor["shape"] = [len(data), 1]
    status, reply = call(daemon, "/v2/models/echo/infer", {"inputs": [tensor]})
    assert (status, reply["code"]) == (400, "bad_request"), reply
    assert "'feature'" in reply["error"] and rule in reply["error"], reply


@pytest.mark.parametrize("datatype, data", [("FP16", [1.5, 65504]), ("FP32", [1, 2.5]), ("INT64", [-3, 2 ** 62]),
                                            ("UINT8", [0, 255]), ("BOOL", [True, False])])
def test_v2_numbers_the_datatype_holds_reach_the_model(daemon, datatype, data):
    tensor = {"name": "feature", "datatype": datatype, "shape": [len(data)], "data": data}
    status, reply = call(daemon, "/v2/models/echo/infer", {"inputs": [tensor]})
    assert status == 200 and reply["outputs"][0]["data"] == data, reply


# -- 3. request slots -----------------------------------------------------------------

def test_slow_bodies_take_no_request_slot(daemon):
    """max_requests (2) clients each send a head and one byte of the body, then wait: the door reads
    their heads (it says 100 Continue) but holds no slot for them, so a whole request and every
    probe are still answered; the slow ones then finish normally."""
    body = b'{"model": "enc", "input": "slow"}'
    held = []
    try:
        for _ in range(2):
            sock = socket.create_connection(("127.0.0.1", daemon.port), timeout=60)
            held.append(sock)
            sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
            assert sock.recv(64).startswith(b"HTTP/1.1 100 ")
            sock.sendall(body[:1])
        status, reply = call(daemon, "/v1/embeddings", {"model": "enc", "input": "x"})
        assert status == 200, reply
        for path in PROBES:
            assert call(daemon, path)[0] == 200, path
        for sock in held:
            sock.sendall(body[1:])
            status, reply = read_reply(sock)
            assert status == 200, reply
    finally:
        for sock in held:
            sock.close()


def test_requests_beyond_max_requests_are_answered_429(daemon):
    """Two requests held in progress (queued in a channel whose window is ten minutes, until a
    third fills its batch), the third HTTP request is 429; probes and metadata are still 200. A
    ZeroMQ request then fills the batch and the two are answered."""
    from dynbatchd.client import Client

    results: list = []
    held = [threading.Thread(target=lambda i=i: results.append(
        call(daemon, "/v1/embeddings", {"model": "enc", "input": f"held {i}"}, {"X-Tags": "held"})))
        for i in range(2)]
    for thread in held:
        thread.start()
    try:
        wait_until(lambda: daemon.status()["channels"]["held"]["queue_depth"] == 2, 60,
                   message="the two requests were not queued")
        status, reply = call(daemon, "/v1/embeddings", {"model": "enc", "input": "x"})
        assert (status, reply["error"]["code"]) == (429, "overloaded"), reply
        for path in PROBES:
            assert call(daemon, path)[0] == 200, path
    finally:
        with Client(daemon.endpoint) as client:
            assert client.infer("enc", "third", tags=["held"], timeout=60) is not None
        for thread in held:
            thread.join(60)
    assert sorted(status for status, _ in results) == [200, 200], results
    assert call(daemon, "/v1/embeddings", {"model": "enc", "input": "x"})[0] == 200
