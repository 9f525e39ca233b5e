"""Empty text ("" or whitespace only) is refused bad_request at admission, over ZeroMQ and over HTTP,
instead of being embedded (a model's answer to nothing is noise that looks like an answer)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import msgspec
import pytest
import zmq

from conftest import free_port, start_daemon
from dynbatchd import protocol as P
from dynbatchd.transport import validate

BODY = """
    [models.echo]
    runner = "callable"
    options = { target = "helpers:echo_or_fail" }
    [models.enc]
    runner = "callable"
    options = { target = "helpers:embed" }
    [channels.standard]
    max_batch = 8
    window_ms = 2
    [routing]
    default = "standard"
"""
EMPTY = ["", " ", "\\t\\n  \\r", "\\u3000"]   # (escaped here: the literals below are decoded)
EMPTY = [json.loads(f'"{t}"') for t in EMPTY]


@pytest.mark.parametrize("text", EMPTY)
def test_validate_refuses_empty_text(text):
    problem = validate(P.Request(1, "echo", text=text), [])
    assert problem and "empty" in problem


def test_validate_keeps_a_text_with_something_in_it():
    assert validate(P.Request(1, "echo", text=" a "), []) is None
    assert validate(P.Request(1, "echo", value=""), []) is None   # a plain value is the model's to judge


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    port = free_port()
    running = start_daemon(tmp_path_factory.mktemp("empty"), BODY + f'\n[http]\nlisten = "127.0.0.1:{port}"\n')
    running.http = f"http://127.0.0.1:{port}"
    yield running
    running.stop()


def test_zeromq_answers_empty_text_bad_request(daemon):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    try:
        for i, text in enumerate([*EMPTY, "fine"]):
            sock.send(msgspec.msgpack.encode({"id": i, "model": "echo", "text": text}))
        replies = {}
        while len(replies) < len(EMPTY) + 1 and sock.poll(20_000):
            reply = P.reply_decoder.decode(sock.recv_multipart()[0])
            replies[reply.id] = reply
    finally:
        sock.close()
    for i in range(len(EMPTY)):
        assert not replies[i].ok and replies[i].error.code == P.BAD_REQUEST, replies[i]
        assert "empty" in replies[i].error.message
    assert replies[len(EMPTY)].ok


def post(daemon, path: str, body: dict):
    request = urllib.request.Request(daemon.http + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("path, body", [
    ("/v1/embeddings", {"model": "enc", "input": ""}),
    ("/v1/embeddings", {"model": "enc", "input": "   "}),
    ("/v1/embeddings", {"model": "enc", "input": ["fine", "\n"]}),
    ("/v2/models/enc/infer", {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [""]}]}),
])
def test_http_answers_empty_text_400_bad_request(daemon, path, body):
    status, reply = post(daemon, path, body)
    # (KServe v2's error is a string with the code beside it; OpenAI's a {code, message} map)
    code, message = (reply["code"], reply["error"]) if path.startswith("/v2/") else \
        (reply["error"]["code"], reply["error"]["message"])
    assert status == 400 and code == "bad_request", reply
    assert "empty" in message
    assert post(daemon, "/v1/embeddings", {"model": "enc", "input": "fine"})[0] == 200
