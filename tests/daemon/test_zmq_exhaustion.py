"""What one client can make the ZeroMQ front door and the control socket hold, or whom it can starve.

Found by a resource-exhaustion pass on a live daemon: a message of millions of empty frames (2 bytes
each on the wire, nothing against max_request_bytes) was served as a request after holding the event
loop for seconds; a tenant name of 64 KiB per request was kept in the quota table (5,000: +315 MiB);
1,024 idle TCP connections (the usual soft descriptor limit) left no descriptor to accept anyone for
30 s at a time; a client that stopped reading and went quiet kept its unread replies in the daemon
until it exited; a drain of 128 control commands of 25 ms each (status, 100,000 tenants) held every
request 3 s. Each test polls with a deadline; none waits on a sleep.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from conftest import REPO, SIMULATED, TESTS, Daemon, free_port, wait_until
from dynbatchd import loopsocket, protocol as P
from dynbatchd.client import Client
from dynbatchd.control import server as control_server
from dynbatchd.control.server import ControlServer
from dynbatchd.loopsocket import SKIP_SLICE, LoopSocket, Oversized
from dynbatchd.transport import MAX_REQUEST_FRAMES, FrontEnd


def _dealer(endpoint: str, ctx: zmq.Context | None = None) -> zmq.Socket:
    sock = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _reply(sock: zmq.Socket) -> dict:
    assert sock.poll(30_000), "no reply"
    return msgspec.msgpack.decode(sock.recv_multipart()[0])


def test_a_request_of_200000_empty_frames_is_bad_request_and_the_next_one_is_served(sim_daemon):
    """The frames of one message are capped (a header and the raw frames it references), so one of
    millions is refused, its excess dropped unread, instead of run after seconds of the loop."""
    sock = _dealer(sim_daemon.endpoint)
    try:
        head = msgspec.msgpack.encode({"id": 1, "model": "echo", "text": "hi"})
        sock.send_multipart([head] + [b""] * 200_000)
        sock.send_multipart([msgspec.msgpack.encode({"id": 2, "model": "echo", "text": "next"}), b"", b""])
        first, second = _reply(sock), _reply(sock)
    finally:
        sock.close()
    assert first["id"] == 1 and first["error"]["code"] == P.BAD_REQUEST, first
    assert f"request of 200001 frames: at most {MAX_REQUEST_FRAMES}" in first["error"]["message"]
    assert second == {**second, "id": 2, "ok": True, "value": "next"}   # 3 frames: well within the cap


class _Turns:
    """An event loop as `LoopSocket` sees it: `call_soon` only records that a drain was asked for."""

    def __init__(self):
        self.asked = []

    def call_soon(self, callback, *args):
        self.asked.append(callback)


def test_the_excess_of_an_oversized_message_is_dropped_a_slice_a_loop_turn():
    """Dropping takes ~0.5 us a frame: in one go, 5,000,000 frames held every other callback 2.5 s."""
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind("inproc://oversized")
    dealer.connect("inproc://oversized")
    seen: list = []
    io = LoopSocket(router, seen.extend, max_frames=4)
    io._loop = loop = _Turns()
    try:
        dealer.send_multipart([b"head"] + [b"x"] * (3 * SKIP_SLICE))
        dealer.send_multipart([b"after"])
        wait_until(lambda: router.poll(0), 10)
        turns = 0
        while not seen:
            io._drain()
            turns += 1
            assert seen or loop.asked, "a drain cut short must come back on the next loop turn"
            loop.asked.clear()
        assert turns >= 3
        cut = seen[0]
        assert type(cut) is Oversized and cut.count == 2 + 3 * SKIP_SLICE and cut.size == len(b"head") + 3 * SKIP_SLICE
        assert len(cut) == 4 and cut[1] == b"head"   # what is kept: the envelope and the header
        wait_until(lambda: io._drain() or len(seen) == 2, 10)
        assert seen[1][1:] == [b"after"]   # the next message, whole
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()


@pytest.mark.parametrize("length, ok", [(P.MAX_TENANT_CHARS, True), (P.MAX_TENANT_CHARS + 1, False)])
def test_a_tenant_name_is_at_most_1024_characters(sim_daemon, length, ok):
    """Tenants are kept by name (quota table, top-users sketch, answers per tenant): a name, not a payload."""
    sock = _dealer(sim_daemon.endpoint)
    try:
        sock.send(msgspec.msgpack.encode({"id": 7, "model": "echo", "text": "hi", "tenant": "t" * length}))
        reply = _reply(sock)
    finally:
        sock.close()
    if ok:
        assert reply["ok"], reply
    else:
        assert reply["error"] == {"code": P.BAD_REQUEST,
                                  "message": f"tenant must be at most {P.MAX_TENANT_CHARS} characters, got {length}"}


WITH_256_DESCRIPTORS = ("import os, resource, sys; hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
                        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)); os.execvp(sys.argv[1], sys.argv[1:])")


def _open_files_limits(pid: int) -> tuple[int, int]:
    line = next(x for x in Path(f"/proc/{pid}/limits").read_text().splitlines() if x.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    return int(soft), int(hard)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_idle_tcp_connections_take_no_descriptor_anyone_else_needs(tmp_path):
    """400 connections that never greet, against a soft limit of 256: the daemon takes its hard limit
    and closes each within HANDSHAKE_MS, so a client is still served (it waited 30 s a wave)."""
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2048:
        pytest.skip("a hard limit on open files too low to show it")
    endpoint, control = f"tcp://127.0.0.1:{free_port()}", f"ipc://{tmp_path}/ctl.sock"
    config = textwrap.dedent(f"""
        [daemon]
        listen = "{endpoint}"
        control = "{control}"
        state_dir = "{tmp_path}/state"
        [devices]
        use = ["cpu"]
        cpu_threads = 1
    """) + textwrap.dedent(SIMULATED)
    daemon = Daemon(tmp_path / "dynbatchd.toml", endpoint, control, config_text=config, log=tmp_path / "daemon.log",
                    pythonpath=[TESTS, REPO], wrap=[sys.executable, "-c", WITH_256_DESCRIPTORS])
    idle: list[socket.socket] = []
    with daemon.start(120):
        soft, hard = _open_files_limits(daemon.pid)
        assert soft == hard > 256, (soft, hard)
        host, port = endpoint[len("tcp://"):].rsplit(":", 1)
        for _ in range(400):
            idle.append(socket.create_connection((host, int(port))))
        try:
            with Client(endpoint, timeout=20) as client:
                assert client.infer("echo", "still served") == "still served"
            for sock in idle:   # each is closed: the daemon's greeting, then the end
                sock.settimeout(3 * loopsocket.HANDSHAKE_MS / 1000)
                try:
                    while sock.recv(4096):
                        pass
                except ConnectionResetError:
                    pass
                except TimeoutError:
                    pytest.fail(f"a connection that never greeted still open {3 * loopsocket.HANDSHAKE_MS} ms on")
        finally:
            for sock in idle:
                sock.close()


def test_a_quiet_client_that_stopped_reading_is_disconnected_and_its_replies_let_go(monkeypatch):
    """Its unread replies (up to SNDHWM, 100,000, per connection) stayed queued in the daemon for as
    long as the connection stood; heartbeats end a connection that answers nothing."""
    monkeypatch.setattr(loopsocket, "HEARTBEAT_MS", 100)
    monkeypatch.setattr(loopsocket, "HEARTBEAT_TIMEOUT_MS", 300)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    big = "y" * 65536

    async def main() -> bool:
        ctx = zmq.Context()
        front = FrontEnd(ctx, endpoint, 1 << 20, lambda env, req, frames: front.reply(env, P.Reply(req.id, True, value=big)))
        front.io.start(asyncio.get_running_loop())
        monitor = front.io.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)   # (the client, reading nothing, sees nothing)
        client = ctx.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.setsockopt(zmq.RCVHWM, 10)   # its own queue fills at once: from then on it reads nothing
        client.connect(endpoint)
        try:
            for i in range(400):
                client.send(msgspec.msgpack.encode({"id": i, "model": "m", "text": "x"}))
            deadline = asyncio.get_running_loop().time() + 10
            while asyncio.get_running_loop().time() < deadline:
                if monitor.poll(0) and recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
                    return True
                await asyncio.sleep(0.02)
            return False
        finally:
            front.io.sock.disable_monitor()
            for sock in (monitor, client):
                sock.close(0)
            front.close()
            ctx.destroy(0)

    assert asyncio.run(main()), "the daemon kept the connection of a client that answers nothing"


class _StatusDaemon:
    """What the control server reads of a daemon for `status` and `ping`, counting the statuses made."""

    state = "serving"

    def __init__(self):
        self.operations = self
        self.made = 0

    def status(self):
        self.made += 1
        return {"daemon": {"state": self.state}, "compliance": {"recent": []}}


def test_a_client_keys_status_is_made_at_most_once_a_second():
    """A key that may only read cannot make the daemon compute a status (25 ms at 100,000 tenants)
    per request of a flood; an admin's is always made afresh."""
    daemon, ctx = _StatusDaemon(), zmq.Context()
    server = ControlServer(ctx, "inproc://status-once", daemon)
    now = [0]
    server.clock = lambda: now[0]
    raw = msgspec.msgpack.encode({"cmd": "status"})
    try:
        replies = [server.handle(raw, admin=False, who="alice") for _ in range(100)]
        assert daemon.made == 1 and all(r == {"ok": True, "result": {"daemon": {"state": "serving"}}} for r in replies)
        now[0] += control_server.CLIENT_STATUS_NS
        server.handle(raw, admin=False, who="alice")
        assert daemon.made == 2
        server.handle(raw)
        server.handle(raw)
        assert daemon.made == 4
    finally:
        server.io.sock.close(0)
        ctx.term()


def test_the_control_socket_handles_a_few_commands_a_loop_turn():
    """A flood of commands waits its turn: a drain of 128 of them held every request (3 s at 25 ms each)."""
    daemon, ctx = _StatusDaemon(), zmq.Context()
    server = ControlServer(ctx, "inproc://a-few-a-turn", daemon)
    server.io._loop = loop = _Turns()
    client = _dealer("inproc://a-few-a-turn", ctx)
    try:
        for _ in range(50):
            client.send(msgspec.msgpack.encode({"cmd": "status"}))
        wait_until(lambda: server.io.sock.poll(0), 10)
        server.io._drain()
        assert daemon.made == control_server.DRAIN_LIMIT and loop.asked
        while daemon.made < 50:
            server.io._drain()
        assert sum(1 for _ in iter(lambda: client.poll(0) and client.recv(), False)) == 50
    finally:
        client.close(0)
        server.io.sock.close(0)
        ctx.term()


def test_a_control_request_of_many_frames_is_refused_in_one_line(sim_daemon):
    sock = _dealer(sim_daemon.control)
    try:
        sock.send_multipart([msgspec.msgpack.encode({"cmd": "ping"})] + [b""] * 1000)
        reply = _reply(sock)
        sock.send_multipart([msgspec.msgpack.encode({"cmd": "ping"}), b""])   # a frame or two more: as before
        assert _reply(sock) == {"ok": True, "result": {"state": "serving"}}
    finally:
        sock.close()
    assert reply == {"ok": False, "error": "a control request is one frame (a MessagePack map), not 1001"}
