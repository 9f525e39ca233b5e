"""No request content in any log line, at any level: the daemon runs at log level debug and
every error path gets inputs carrying one unique marker; the marker must never show in what the
daemon and its workers write (their stdout and stderr, one file).

The paths: frames that are not a request, malformed headers, a request over max_request_bytes
(and one over the socket's hard limit), an unknown model, a compliance refusal, a model that
fails a batch, a worker crash (the callable model `helpers:echo_or_fail` exits on an input
starting "crash"; twice, so the input is quarantined), an expired deadline, a reply the client
left before, and control requests that are malformed, unknown or refused. (A hung worker is not
tried: it takes batch_timeout_s.)
"""

from __future__ import annotations

import uuid

import msgspec
import numpy as np
import pytest
import zmq

from conftest import start_daemon

MARKER = "zq" + uuid.uuid4().hex   # 34 characters no log could hold by chance
PIECES = (MARKER, MARKER[:14], MARKER[-14:], MARKER.encode().hex()[:24])

BODY = """
    [models.echo]
    runner = "callable"
    options = { target = "helpers:echo_or_fail" }
    [models.slow]
    runner = "simulated"
    options = { base_ms = 300.0 }
    [channels.standard]
    max_batch = 16
    window_ms = 20
    deadline_ms = 30000
    [channels.vault]
    max_batch = 4
    window_ms = 5
    isolated = true
    [routing]
    default = "standard"
    [[routing.rules]]
    tag = "banking"
    channel = "vault"
"""


def pack(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


def dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def collect(sock: zmq.Socket, count: int, timeout_ms: int = 60_000) -> list[dict]:
    got = []
    while len(got) < count:
        assert sock.poll(timeout_ms), f"{len(got)} of {count} replies"
        frames = sock.recv_multipart()
        got.append(msgspec.msgpack.decode(frames[-1] if frames[0] == b"" else frames[0]))
    return got


@pytest.fixture(scope="module")
def debug_daemon(tmp_path_factory):
    daemon = start_daemon(tmp_path_factory.mktemp("nolog"), BODY,
                          daemon_extra='log_level = "debug"\nmax_request_bytes = 4096')
    yield daemon
    if daemon.proc.poll() is None:
        daemon.stop()


def test_no_error_path_logs_a_payload(debug_daemon):
    endpoint = debug_daemon.endpoint
    m, mb = MARKER, MARKER.encode()
    sock = dealer(endpoint)
    sent = 0

    def send(frames: list[bytes], replies: int = 1) -> None:
        nonlocal sent
        sock.send_multipart(frames)
        sent += replies

    try:
        # Frames that are not a request at all.
        send([b"\xc1" + mb])                                   # not MessagePack
        send([mb])                                             # text, not a map
        send([pack([m, m])])                                   # an array, not a map
        send([pack({"id": 1, "model": "echo", "text": m}), mb, mb])   # frames nobody asked for
        send([b"", mb])                                        # a delimiter, then garbage
        # Malformed headers.
        send([pack({"id": 2, "model": m, "text": 5})])        # wrong type
        send([pack({"id": [m], "model": "echo", "text": m})])  # an id that is no id
        send([pack({"id": 3, "model": "echo", "text": m, "value": m})])   # two inputs
        send([pack({"id": 4, "model": "echo", "text": m, "v": 99})])      # another protocol version
        send([pack({"id": 5, "model": "echo", "text": m, "tokens": -1})])
        send([pack({"id": 6, "model": "echo", "text": m, "deadline_ms": 0})])
        send([pack({"id": 7, "model": "echo", "value": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[m]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]})])
        send([pack({"id": 8, "model": "echo", "tensor": {"dtype": "float32", "shape": [99], "frame": 0}}), mb])
        send([pack({"id": 9, "model": "echo", "tensor": {"dtype": m, "shape": [1], "frame": 0}}), mb])
        send([pack({"id": 10, "model": "echo", "text": m, "tags": [m, 1]})])
        # Too big for max_request_bytes (a polite bad_request).
        send([pack({"id": 11, "model": "echo", "text": m * 200})])
        # An unknown model, and a request the compliance plugin refuses (regulated, not isolated).
        send([pack({"id": 12, "model": m, "text": m})])
        send([pack({"id": 13, "model": "echo", "text": m, "tags": ["medical"], "tenant": m, "user": m})])
        # A model failure: "fail" poisons its batch, the marker inputs share it and are isolated.
        send([pack({"id": 14, "model": "echo", "text": "fail"})])
        for i in range(4):
            send([pack({"id": 100 + i, "model": "echo", "text": f"{m} {i}", "tenant": m, "user": m})])
        send([pack({"id": 15, "model": "echo", "value": {"k": m, "n": [1, 2, m]}})])
        send([pack({"id": 16, "model": "echo", "tensor": {"dtype": "uint8", "shape": [len(mb)], "frame": 0}}), mb])
        # An expired deadline, and banking traffic in its isolated channel.
        send([pack({"id": 17, "model": "slow", "text": m, "deadline_ms": 0.001})])
        send([pack({"id": 18, "model": "echo", "text": m, "tags": ["banking"], "tenant": m})])
        replies = collect(sock, sent)
        codes = sorted((r.get("error") or {}).get("code", "ok") for r in replies)
        assert "bad_request" in codes and "unknown_model" in codes and "refused" in codes
        assert "model_error" in codes, codes

        # A worker crash, twice (the input is then quarantined).
        for attempt in range(2):
            sock.send(pack({"id": 200 + attempt, "model": "echo", "text": f"crash {m}"}))
            (crashed,) = collect(sock, 1, 120_000)
            assert crashed["error"]["code"] == "model_error", crashed
        sock.send(pack({"id": 202, "model": "echo", "text": f"crash {m}"}))
        (quarantined,) = collect(sock, 1, 120_000)
        assert quarantined["error"]["code"] == "model_error"
    finally:
        sock.close()

    # Over the socket's hard limit (4 x max_request_bytes, at least 1 MiB): the connection drops.
    big = dealer(endpoint)
    big.send(pack({"id": 19, "model": "echo", "text": m * 40_000}))
    assert not big.poll(500)
    big.close()
    # A reply its client does not stay for (the daemon logs at debug that it was undeliverable).
    gone = zmq.Context.instance().socket(zmq.DEALER)
    gone.setsockopt(zmq.LINGER, 1000)
    gone.connect(endpoint)
    gone.send(pack({"id": 20, "model": "slow", "text": m}))
    gone.close()

    # The control socket: garbage, an unknown command, bad arguments, refused values.
    ctl = dealer(debug_daemon.control)
    try:
        for frame in (b"\xc1" + mb, mb, pack({"cmd": m}), pack({"cmd": "tune", "args": {"channel": m}}),
                      pack({"cmd": "tune", "args": {"channel": "standard", m: 1}}),
                      pack({"cmd": "tune", "args": {"channel": "standard", "window_ms": m}}),
                      pack({"cmd": "ping", "args": {m: m}}), pack({"cmd": "warmup", "args": {"model": m}}),
                      pack({"cmd": m, "args": [m]})):
            ctl.send(frame)
            assert ctl.poll(10_000), "no answer from the control socket"
            answer = msgspec.msgpack.decode(ctl.recv())
            assert answer["ok"] is False
    finally:
        ctl.close()

    assert debug_daemon.call("ping")["state"] == "serving"
    assert debug_daemon.stop() == 0
    logged = debug_daemon.logs()
    assert " DEBUG " in logged, "the daemon did not log at debug: the test proves nothing"
    assert "exited with" in logged, "no worker crashed: the crash path was not taken"
    leaks = [line for line in logged.splitlines() if any(piece in line for piece in PIECES)]
    assert not leaks, "request content in the daemon's log:\n" + "\n".join(leaks[:20])


def test_the_marker_would_be_found(tmp_path):
    """The check itself: a log line with the marker (or a piece of it) is caught."""
    for line in (f"x {MARKER} y", f"x {MARKER[:14]}...", repr(MARKER.encode())):
        assert any(piece in line for piece in PIECES)
    assert not any(piece in "an ordinary log line" for piece in PIECES)
    assert np.frombuffer(MARKER.encode(), np.uint8).size == len(MARKER)
