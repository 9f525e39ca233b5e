"""The daemon end to end, in a subprocess, over real ZeroMQ sockets (simulated and callable models)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from dynbatchd import protocol as P
from dynbatchd.client import (BadRequest, Client, DeadlineExceeded, DynbatchdError, ModelError, Overloaded,
                              Refused, UnknownModel, build_request, parse_reply)
from conftest import SIMULATED, Daemon, start_daemon
from helpers import codes, outcomes, wait_until


def raw_exchange(endpoint: str, frames: list, timeout_ms: int = 10_000) -> list[bytes] | None:
    """Send raw frames on a fresh DEALER; return the reply frames, or None if none came."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(frames)
        return sock.recv_multipart() if sock.poll(timeout_ms) else None
    finally:
        sock.close()


def error_of(frames: list[bytes]) -> tuple[object, str]:
    reply = P.reply_decoder.decode(frames[0])
    assert not reply.ok
    return reply.id, reply.error.code


def test_simulated_reply_carries_own_output_and_timing(sim_daemon):
    with Client(sim_daemon.endpoint) as client:
        result = client.infer_result("sim", "abcdef", tokens=7)
    assert result.output.tolist() == [6.0, 7.0]        # [input length, tokens]: this request's own answer
    assert result.timing.simulated and result.timing.channel == "standard"
    assert result.timing.batch_size >= 1 and result.timing.total_us >= result.timing.compute_us


def test_routing_sends_urgent_to_realtime(sim_daemon):
    with Client(sim_daemon.endpoint) as client:
        assert client.infer_result("sim", "x", tags=["urgent"]).timing.channel == "realtime"
        assert client.infer_result("sim", "x").timing.channel == "standard"


@pytest.mark.parametrize("frames, code", [
    ([b"\xc1\x00garbage"], P.BAD_REQUEST),                                            # not msgpack
    ([msgspec.msgpack.encode({"id": 1, "model": 5, "text": "x"})], P.BAD_REQUEST),    # wrong type
    ([msgspec.msgpack.encode({"id": 2, "model": "sim"})], P.BAD_REQUEST),             # no input
    ([msgspec.msgpack.encode({"id": 3, "model": "sim", "text": "a", "value": 1})], P.BAD_REQUEST),
    ([msgspec.msgpack.encode({"id": 4, "model": "sim", "tensor": {"dtype": "float32", "shape": [4], "frame": 0}}),
      b"\x00" * 15], P.BAD_REQUEST),                                                  # frame size mismatch
    ([msgspec.msgpack.encode({"id": 5, "model": "sim", "text": "a", "v": 99})], P.BAD_REQUEST),
    ([msgspec.msgpack.encode({"id": 6, "model": "nope", "text": "a"})], P.UNKNOWN_MODEL),
    ([msgspec.msgpack.encode({"id": 7, "model": "sim", "text": "a" * (2 << 20)})], P.BAD_REQUEST),  # oversized
    ([msgspec.msgpack.encode({"id": 8, "model": "sim", "text": "a", "deadline_ms": float("inf")})], P.BAD_REQUEST),
    ([msgspec.msgpack.encode({"id": 9, "model": "sim", "tokens": -3,
                              "tensor": {"dtype": "uint8", "shape": [1], "frame": 0}}), b"\x01"], P.BAD_REQUEST),
    # Shapes numpy cannot hold though the byte count matches (they killed the worker that reshaped them):
    ([msgspec.msgpack.encode({"id": 10, "model": "echo", "tensor": {"dtype": "uint8", "shape": [0, 2**63]}}),
      b""], P.BAD_REQUEST),
    ([msgspec.msgpack.encode({"id": 11, "model": "echo", "tensor": {"dtype": "uint8", "shape": [1] * 65}}),
      b"\x01"], P.BAD_REQUEST),
])
def test_bad_input_gets_an_error_reply_and_the_daemon_keeps_serving(sim_daemon, frames, code):
    reply = raw_exchange(sim_daemon.endpoint, frames)
    assert reply is not None, "no reply to a bad request"
    req_id, got = error_of(reply)
    assert got == code
    with Client(sim_daemon.endpoint) as client:
        assert client.infer("sim", "still alive").tolist() == [11.0, 3.0]


def test_unknown_model_and_bad_request_raise_typed_errors(sim_daemon):
    with Client(sim_daemon.endpoint) as client:
        with pytest.raises(UnknownModel) as info:
            client.infer("missing", "x")
        assert info.value.code == "unknown_model"
        with pytest.raises(BadRequest):
            client.infer("sim", "x", deadline_ms=-1)


def test_tensor_input_travels_as_raw_frame(sim_daemon):
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    frames = build_request(41, "echo", arr)
    reply, output = parse_reply(raw_exchange(sim_daemon.endpoint, frames))
    assert reply.ok and reply.id == 41
    assert np.array_equal(output, arr)


def test_one_failing_input_does_not_harm_its_batch(sim_daemon):
    with Client(sim_daemon.endpoint) as client:
        futures = [client.submit("echo", text) for text in ("a", "fail", "b", "c")]
        assert outcomes(futures, timeout=30) == ["a", "model_error", "b", "c"]
        # The poison really rode with the others: the innocent ran in a batch of more than one.
        assert max(futures[i].result().timing.batch_size for i in (0, 2, 3)) > 1


def test_regulated_tag_outside_isolated_channel_is_refused(sim_daemon):
    with Client(sim_daemon.endpoint) as client:
        # banking routes to the isolated vault channel: allowed.
        assert client.infer_result("sim", "x", tags=["banking"], tenant="t1").timing.channel == "vault"
        # medical has no routing rule, lands in standard (not isolated): refused with the rule's reason.
        with pytest.raises(Refused, match="isolated"):
            client.infer("sim", "x", tags=["medical"])


def test_expired_request_is_answered_deadline_exceeded(sim_daemon):
    with Client(sim_daemon.endpoint) as client:
        with pytest.raises(DeadlineExceeded):
            client.infer("sim", "x", deadline_ms=0.001)


def test_status_reports_channels_and_devices(sim_daemon):
    with Client(sim_daemon.endpoint) as client:
        client.infer("sim", "warm")
    status = sim_daemon.status()
    assert status["daemon"]["state"] == "serving"
    assert 0 <= status["daemon"]["health"]["score"] <= 1
    passes = status["daemon"]["scheduling"]   # the passes that cut batches, timed
    assert passes["passes"] >= 1 and passes["seconds"] > 0 and 0 <= passes["over_lead"] <= passes["passes"]
    std = status["channels"]["standard"]
    for key in ("queue_depth", "batches", "mean_batch", "fill_rate", "p50_ms", "p99_ms", "rejected", "deadline_misses"):
        assert key in std
    assert std["batches"] >= 1
    [device] = status["devices"]
    assert device["device"] == "cpu" and device["pid"] > 0 and device["simulated"]


def test_dynbatchctl_status_and_plugins_json(sim_daemon):
    def ctl(*args):
        out = subprocess.run([str(Path(sys.executable).parent / "dynbatchctl"), "--control", sim_daemon.control,
                              *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout
    status = json.loads(ctl("status", "--json"))
    assert set(status["channels"]) == {"standard", "realtime", "vault"}
    plugins = json.loads(ctl("plugins", "--json"))
    assert {"routing", "windows", "compliance", "runners", "sizing"} <= {p["name"] for p in plugins["loaded"]}
    assert "simulated" in plugins["runners"]
    assert "channels" in ctl("status")  # the rich table for people
    with Client(sim_daemon.endpoint) as client:   # traffic for the recommender: it needs 20 timed batches
        for _ in range(25):
            for f in [client.submit("sim", "x" * 10) for _ in range(2)]:
                f.result(timeout=30)
    plan = json.loads(ctl("recommend", "--json", "--duration", "2"))
    assert plan["simulated"] is True and "standard" in plan["channels"]
    assert plan["channels"]["standard"]["current"]["max_batch"] == 16


def test_tune_changes_a_channel_and_rejects_broken_values(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED)   # its own: the shared sim_daemon keeps its settings
    try:
        new = daemon.call("tune", channel="realtime", window_ms=2.0)
        assert new["applied"] and new["settings"]["window_ms"] == 2.0   # the plan, and the settings after it
        assert daemon.status()["channels"]["realtime"]["window"]["window_ms"] == 2.0
        with pytest.raises(Exception, match="max_batch"):
            daemon.call("tune", channel="realtime", max_batch=0)
        assert daemon.call("config")["channels"]["realtime"]["max_batch"] == 8
    finally:
        assert daemon.stop() == 0


def test_overload_is_answered_not_dropped(tmp_path):
    daemon = start_daemon(tmp_path, """
        [models.slow]
        runner = "simulated"
        options = { base_ms = 50.0 }
        [channels.standard]
        max_batch = 1
        window_ms = 0
        deadline_ms = 60000
        queue_limit = 4
        [routing]
        default = "standard"
    """)
    try:
        with Client(daemon.endpoint) as client:
            got = codes([client.submit("slow", "x") for _ in range(30)], timeout=60)
        assert set(got) <= {"ok", Overloaded.code}, got
        assert len(got) == 30 and got.count("overloaded") > 0 and got.count("ok") >= 4
        assert daemon.status()["channels"]["standard"]["rejected"]["overloaded"] == got.count("overloaded")
    finally:
        assert daemon.stop() == 0


def test_sigterm_drains_every_accepted_request(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED)
    with Client(daemon.endpoint) as client:
        futures = [client.submit("sim", f"r{i}") for i in range(200)]
        # Stop once the daemon has accepted everything (its status counts them), not after a guess.
        wait_until(lambda: sum(c["accepted"] for c in daemon.status()["channels"].values()) >= 200, 30,
                   message="the daemon did not accept all 200 requests")
        assert daemon.stop() == 0
        answered = [f.result(timeout=30) for f in futures]
    assert len(answered) == 200
    assert [r.output.tolist()[0] for r in answered] == [len(f"r{i}") for i in range(200)]


def test_a_worker_that_dies_is_restarted_and_its_requests_answered(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED)
    try:
        with Client(daemon.endpoint) as client:
            # The poison input shares its first batch with innocent ones (a 5 ms window).
            futures = [client.submit("echo", text, deadline_ms=60_000, timeout=120)
                       for text in ("a", "crash", "b", "c")]
            got = outcomes(futures, timeout=120)
            assert got == ["a", "model_error", "b", "c"]
            assert "died" in got[1].message
            # Every request cut twice was on the worker when it died: the poison's batch (each of
            # its requests then runs once more, alone) and any batch queued behind it. A poison
            # that had run alone would leave one batch of one; all four together, 8 items in 5.
            standard = daemon.status()["channels"]["standard"]
            items = round(standard["mean_batch"] * standard["batches"])
            assert standard["mean_batch"] > 1 and items - len(futures) >= 2, standard
            assert client.infer("echo", "after", deadline_ms=60_000, timeout=120) == "after"
        [device] = daemon.status()["devices"]
        assert device["restarts"] >= 1 and device["state"] == "ready"
    finally:
        daemon.stop()


def test_prometheus_metrics_endpoint(sim_daemon):
    import urllib.error
    import urllib.request

    with Client(sim_daemon.endpoint) as client:
        client.infer("sim", "counted")
    body = urllib.request.urlopen(sim_daemon.metrics_url, timeout=10).read().decode()
    assert "# TYPE dynbatchd_requests_completed_total counter" in body
    completed = [line for line in body.splitlines()
                 if line.startswith('dynbatchd_requests_completed_total{channel="standard"}')]
    assert completed and float(completed[0].split()[-1]) >= 1
    assert 'dynbatchd_device_busy_ratio{device="cpu",simulated="true"}' in body
    assert "# TYPE dynbatchd_request_duration_seconds histogram" in body
    count = [line for line in body.splitlines()
             if line.startswith('dynbatchd_request_duration_seconds_count{channel="standard"}')]
    inf = [line for line in body.splitlines()
           if line.startswith('dynbatchd_request_duration_seconds_bucket{channel="standard",le="+Inf"}')]
    assert float(count[0].split()[-1]) == float(inf[0].split()[-1]) >= 1
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(sim_daemon.metrics_url.replace("/metrics", "/other"), timeout=10)


def test_an_empty_message_has_no_reply_address_and_is_counted(sim_daemon):
    before = sim_daemon.status()["daemon"]["dropped"]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sim_daemon.endpoint)
    sock.send(b"")   # arrives as [identity, b""]: a REQ delimiter with nothing after it
    try:
        wait_until(lambda: sim_daemon.status()["daemon"]["dropped"] > before, 10,
                   message="the empty message was not counted as dropped")
    finally:
        sock.close()


def test_sighup_reloads_and_a_refused_file_keeps_the_running_config(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED)
    try:
        text = daemon.config.read_text()
        daemon.config.write_text(text.replace("window_ms = 1\n", "window_ms = 3\n"))
        daemon.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: daemon.status()["channels"]["realtime"]["window"]["window_ms"] == 3.0, 20,
                   message="SIGHUP did not reload")
        # A file that breaks the banking rule is refused; the daemon keeps serving the old settings.
        broken = text.replace("window_ms = 5\nisolated = true", "window_ms = 500\nisolated = true")
        assert broken != text
        daemon.config.write_text(broken)
        with pytest.raises(Exception, match="banking"):
            daemon.call("reload")
        assert daemon.call("config")["channels"]["vault"]["window_ms"] == 5.0
        with Client(daemon.endpoint) as client:
            assert client.infer("sim", "ok").tolist() == [2.0, 1.0]
    finally:
        daemon.stop()


def test_out_of_memory_splits_the_batch_answers_everyone_and_lowers_the_limit(tmp_path):
    daemon = start_daemon(tmp_path, """
        [models.small]
        runner = "callable"
        options = { target = "helpers:oom_above_four" }
        [channels.standard]
        max_batch = 16
        window_ms = 50
        deadline_ms = 60000
        [routing]
        default = "standard"
    """)
    try:
        with Client(daemon.endpoint) as client:
            futures = [client.submit("small", "x" * (i + 1)) for i in range(16)]
            outputs = [f.result(timeout=60).output for f in futures]
        assert outputs == [float(i + 1) for i in range(16)]
        assert daemon.status()["channels"]["standard"]["max_batch"] < 16
    finally:
        daemon.stop()


def test_a_stop_during_start_up_exits_cleanly_without_serving(tmp_path):
    (tmp_path / "slowmodel.py").write_text(
        "import time\n"
        "time.sleep(120)  # a model that takes long to load\n"
        "def fn(inputs):\n    return inputs\n")
    endpoint, control = f"ipc://{tmp_path}/req.sock", f"ipc://{tmp_path}/ctl.sock"
    config = tmp_path / "c.toml"
    config.write_text(f"""
[daemon]
listen = "{endpoint}"
control = "{control}"
[devices]
use = ["cpu"]
[models.slow]
runner = "callable"
options = {{ target = "slowmodel:fn" }}
[channels.standard]
max_batch = 4
window_ms = 1
[routing]
default = "standard"
""")
    daemon = Daemon(config, endpoint, control, log=tmp_path / "daemon.log", pythonpath=[tmp_path]).launch()
    try:
        def starting() -> bool:
            assert daemon.alive(), daemon.logs()
            try:
                return daemon.ping(timeout_s=1)["state"] == "starting"
            except DynbatchdError:
                return False   # not bound yet
        wait_until(starting, 60, message="the daemon never said it was starting")
        assert daemon.stop(timeout=30) == 0
    finally:
        daemon.kill()


def test_a_hung_worker_is_replaced_and_the_hanging_request_answered(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED, devices_extra="batch_timeout_s = 1.0")
    try:
        with Client(daemon.endpoint) as client:
            with pytest.raises(ModelError, match="hung while running this request alone"):   # quarantined
                client.infer("echo", "hang", deadline_ms=60_000, timeout=60)
            assert client.infer("echo", "fine", deadline_ms=60_000, timeout=60) == "fine"
        assert daemon.status()["devices"][0]["restarts"] >= 1   # alone at once: one hang, one replacement
    finally:
        daemon.stop()
