"""A stop answers everything: requests that arrive in the last moment before SIGTERM (or while
the models still load) get exactly one reply, ``ok`` or ``shutting_down``, never none; and a
clean stop leaves no ipc:// socket file behind."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import zmq

from dynbatchd import protocol as P
from dynbatchd.client import DynbatchdError, build_request
from conftest import SIMULATED, Daemon, start_daemon
from helpers import wait_until


def connected_dealer(endpoint: str) -> zmq.Socket:
    """A DEALER connected to `endpoint`, its handshake done, so what it sends goes out at once."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(endpoint)
    try:
        assert monitor.poll(30_000), f"no handshake with {endpoint}"
    finally:
        sock.disable_monitor()
        monitor.close(0)
    return sock


def replies(sock: zmq.Socket, ids: range, timeout_s: float) -> dict[int, list[str]]:
    """Each id's reply codes ("ok" or the error's), received until every id has one or `timeout_s`."""
    got: dict[int, list[str]] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < len(ids) and sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        reply = P.reply_decoder.decode(sock.recv_multipart()[0])
        got.setdefault(reply.id, []).append("ok" if reply.ok else reply.error.code)
    return got


def no_more(sock: zmq.Socket, got: dict[int, list[str]]) -> dict[int, list[str]]:
    """Whatever else arrives after the daemon exited (a second reply would show here)."""
    while sock.poll(200):
        reply = P.reply_decoder.decode(sock.recv_multipart()[0])
        got.setdefault(reply.id, []).append("ok" if reply.ok else reply.error.code)
    return got


def test_a_burst_just_before_sigterm_is_answered_once_each(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED)
    sock = connected_dealer(daemon.endpoint)
    try:
        ids = range(2000)
        for i in ids:
            sock.send_multipart(build_request(i, "sim", f"r{i}"))
        daemon.proc.send_signal(signal.SIGTERM)   # at once: many are still unread, or in flight
        got = replies(sock, ids, 60)
        assert daemon.stop() == 0, daemon.logs()
        got = no_more(sock, got)
    finally:
        sock.close(0)
        daemon.kill()
    missing = [i for i in ids if i not in got]
    assert not missing, f"{len(missing)} requests got no reply, e.g. {missing[:5]}"
    assert all(len(codes) == 1 for codes in got.values()), {i: c for i, c in got.items() if len(c) > 1}
    assert {codes[0] for codes in got.values()} <= {"ok", "shutting_down"}
    assert sorted(got) == list(ids)
    assert not Path(daemon.endpoint[len("ipc://"):]).exists(), "the request socket's file is left behind"
    assert not Path(daemon.control[len("ipc://"):]).exists(), "the control socket's file is left behind"


def test_requests_waiting_while_the_models_load_are_answered_shutting_down_at_a_stop(tmp_path):
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
state_dir = "{tmp_path}/state"
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
    sock = None
    try:
        def starting() -> bool:
            assert daemon.alive(), daemon.logs()
            try:
                return daemon.ping(timeout_s=1)["state"] == "starting"
            except DynbatchdError:
                return False   # not bound yet
        wait_until(starting, 60, message="the daemon never said it was starting")
        sock = connected_dealer(endpoint)   # the request socket is bound before the models load
        ids = range(50)
        for i in ids:
            sock.send_multipart(build_request(i, "slow", f"r{i}"))
        daemon.proc.send_signal(signal.SIGTERM)
        got = replies(sock, ids, 30)
        assert daemon.stop(timeout=30) == 0, daemon.logs()
        got = no_more(sock, got)
    finally:
        if sock is not None:
            sock.close(0)
        daemon.kill()
    assert got == {i: ["shutting_down"] for i in ids}
    assert not (tmp_path / "req.sock").exists() and not (tmp_path / "ctl.sock").exists()
