"""Faults from outside: what strangers send must cost only their own message an answer."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import msgspec
import pytest
import zmq

from conftest import REPO, SIMULATED, free_port, start_daemon
from dynbatchd import protocol as P
from dynbatchd.client import Client, control_call
from helpers import outcomes, wait_until

DEEP = b"\x83\xa2id\x01\xa5model\xa4echo\xa5value" + b"\x91" * 1000 + b"\xc0"


@pytest.mark.parametrize("depth, answered_ok", [(P.MAX_NESTING - 1, True), (P.MAX_NESTING + 1, False),
                                               (1000, False), (100_000, False)])
def test_nesting_is_bounded_and_every_failure_is_a_malformed_message(depth, answered_ok):
    header = b"\x83\xa2id\x01\xa5model\xa4echo\xa5value" + b"\x91" * depth + b"\xc0"
    if answered_ok:
        assert P.decode_request(header).id == 1
    else:
        with pytest.raises(P.MalformedMessage, match="nested deeper than 32"):
            P.decode_request(header)
        assert P.guess_id(header) == 1   # the client can still match its error


@pytest.mark.parametrize("shape, frame, why", [
    ([0, 2**63], b"", "dimension over"),                         # zero elements match an empty frame
    ([1] * (P.MAX_TENSOR_DIMS + 1), b"\x01", "dimensions (at most"),
])
def test_a_shape_numpy_cannot_hold_is_refused_at_the_door_though_its_bytes_match(shape, frame, why):
    assert why in P.check_tensor(P.TensorRef("uint8", shape), [len(frame)])
    assert P.check_tensor(P.TensorRef("uint8", [1] * P.MAX_TENSOR_DIMS), [1]) is None


def test_guess_id_never_raises_on_garbage():
    for raw in (b"", b"\x83", b"\x83\xa2id", b"\x83\xa2id\xcd\x01", b"\xdf\xff", b"\x91" * 5000, b"\xa2id"):
        assert P.guess_id(raw) is None


def test_deeply_nested_headers_are_answered_alone_and_the_daemon_keeps_serving(sim_daemon):
    """The critical fault: each deep header got no reply, took the valid requests read in the
    same pass with it, and a few hundred of them left the daemon answering nothing."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sim_daemon.endpoint)
    try:
        count = 400
        for i in range(count):   # deep headers interleaved with valid requests, read in the same passes
            sock.send(DEEP)
            sock.send(msgspec.msgpack.encode({"id": 10_000 + i, "model": "echo", "text": f"ok{i}"}))
        replies = {}
        while len(replies) < 2 * count and sock.poll(20_000):
            reply = P.reply_decoder.decode(sock.recv_multipart()[0])
            if reply.id == 1:
                assert reply.error.code == P.BAD_REQUEST and "nested" in reply.error.message
                replies[("deep", len(replies))] = reply
            else:
                assert reply.ok, reply.error
                replies[reply.id] = reply
        assert len(replies) == 2 * count
        assert sum(1 for k in replies if isinstance(k, int)) == count
    finally:
        sock.close()
    with Client(sim_daemon.endpoint) as client:
        assert client.infer("sim", "still alive").tolist() == [11.0, 3.0]
    assert control_call(sim_daemon.control, "ping")["state"] == "serving"


def test_a_deep_control_request_is_refused_and_control_keeps_working(sim_daemon):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sim_daemon.control)
    try:
        for _ in range(50):
            sock.send(b"\x82\xa3cmd\xa4ping\xa4args\x81\xa1x" + b"\x91" * 1000 + b"\xc0")
            assert sock.poll(10_000), "no answer to a deep control request"
            answer = msgspec.msgpack.decode(sock.recv())
            assert answer["ok"] is False and "nested deeper than 32" in answer["error"]
    finally:
        sock.close()
    assert control_call(sim_daemon.control, "ping")["state"] == "serving"


def test_three_poison_inputs_fail_alone_and_do_not_spend_the_restart_budget(tmp_path):
    """The high fault: each poison input killed its worker twice, the restart budget counted
    over the daemon's life, and after three of them the device was given up for good."""
    from dynbatchd.client import ModelError

    daemon = start_daemon(tmp_path, SIMULATED, devices_extra="restart_limit = 1")
    try:
        with Client(daemon.endpoint) as client:
            for round_ in range(3):
                texts = [f"a{round_}", f"crash{round_}", f"b{round_}", f"c{round_}"]
                got = outcomes([client.submit("echo", t, deadline_ms=60_000, timeout=120) for t in texts],
                               timeout=120)
                assert got == [texts[0], "model_error", texts[2], texts[3]]
                assert "quarantined" in got[1].message
            standard = daemon.status()["channels"]["standard"]
            assert standard["mean_batch"] > 1   # the poison shared its first batch with the innocent
            assert client.infer("echo", "still served") == "still served"
            with pytest.raises(ModelError, match="quarantined"):   # known poison: refused at once
                client.infer("echo", "crash1")
        status = daemon.status()
        assert status["daemon"]["quarantined"] == 3 and status["daemon"]["state"] == "serving"
        device = status["devices"][0]
        assert device["state"] == "ready" and device["restarts"] == 6
    finally:
        daemon.stop()


def test_a_reply_to_a_client_that_left_is_counted_not_silently_lost(sim_daemon):
    before = sim_daemon.status()["daemon"]["replies_undelivered"]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 5000)   # the request is flushed before the socket goes
    sock.connect(sim_daemon.endpoint)
    sock.send(msgspec.msgpack.encode({"id": 1, "model": "sim", "text": "bye", "deadline_ms": 60_000}))
    sock.close()                        # gone before the batch window (5 ms) closes
    wait_until(lambda: sim_daemon.status()["daemon"]["replies_undelivered"] > before, 20,
               message="the undeliverable reply was never counted")


# (A tcp:// control address needs CURVE, so the config check refuses it before any bind: see
# test_cli_config_checks.py; the control socket binds through the same `listeners.bind` as `listen`.)
@pytest.mark.parametrize("which", ["listen", "metrics_listen"])
def test_an_address_in_use_is_one_line_and_comes_before_any_model_loads(tmp_path, which):
    port = free_port()
    holder = zmq.Context.instance().socket(zmq.ROUTER) if which != "metrics_listen" else None
    blocker = socket.socket()
    try:
        if holder is not None:
            holder.bind(f"tcp://127.0.0.1:{port}")
        else:
            blocker.bind(("127.0.0.1", port))
            blocker.listen()
        addresses = {"listen": f"ipc://{tmp_path}/req.sock", "control": f"ipc://{tmp_path}/ctl.sock",
                     "metrics_listen": ""}
        addresses[which] = f"127.0.0.1:{port}" if which == "metrics_listen" else f"tcp://127.0.0.1:{port}"
        config = tmp_path / "dynbatchd.toml"
        config.write_text(textwrap.dedent(f"""
            [daemon]
            listen = "{addresses['listen']}"
            control = "{addresses['control']}"
            metrics_listen = "{addresses['metrics_listen']}"
            [devices]
            use = ["cpu"]
            [models.minilm]
            runner = "sentence-embedding"
            [channels.standard]
            max_batch = 8
            window_ms = 5
            [routing]
            default = "standard"
        """))
        out = subprocess.run([sys.executable, "-m", "dynbatchd", "start", "--config", str(config)], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    finally:
        blocker.close()
        if holder is not None:
            holder.close(linger=0)
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert lines == [f"error: {addresses[which] if which != 'metrics_listen' else 'metrics ' + addresses[which]}: "
                     "address already in use"], out.stderr
    assert "Traceback" not in out.stderr and "starting: devices" not in out.stderr   # no model was loaded
