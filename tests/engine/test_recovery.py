"""Nothing the daemon learns can wedge it (issue 23): a batch that cannot be encoded, a device
given up after its worker kept dying.

The first runs the daemon's own scheduling pass in-process against a stand-in pool (the HTTP
door now refuses lone surrogates itself, so no live client can reach the encoder with one); the
others run the daemon in a subprocess over real sockets with tiny timings.
"""

from __future__ import annotations

import asyncio
import textwrap
import time
import tomllib

from conftest import start_daemon, wait_until
from helpers import outcomes

from dynbatchd import protocol as P
from dynbatchd.client import Client
from dynbatchd.config import parse
from dynbatchd.daemon_batches import Pending
from dynbatchd.doors import LocalEnvelope
from dynbatchd.engine import OK, Job
from dynbatchd.plugins import Plugins

ECHO = """
    [models.echo]
    runner = "callable"
    options = { target = "helpers:echo_or_fail" }
    [channels.standard]
    max_batch = 8
    window_ms = 5
    [routing]
    default = "standard"
"""


class StandInPool:
    """What the daemon's scheduling pass sends, kept instead of sent."""

    def __init__(self):
        self.sent: list[list] = []

    def send(self, index: int, frames: list) -> bool:
        self.sent.append(frames)
        return True


def test_a_batch_that_cannot_be_encoded_answers_its_bad_input_and_runs_the_rest(tmp_path):
    """Daemon._pump once let encode_batch's UnicodeEncodeError escape: the bad request and its
    batch-mates went unanswered and the device slot stayed held until the drain timed out."""
    from dynbatchd.service import Daemon

    text = textwrap.dedent(ECHO) + f'[daemon]\nstate_dir = "{tmp_path}"\n[devices]\nuse = ["cpu"]\ninflight = 1\n'
    loop = asyncio.new_event_loop()
    try:
        now = [0]
        daemon = Daemon(parse(tomllib.loads(text)), Plugins.load(), clock=lambda: now[0])
        daemon.loop, daemon.pool = loop, StandInPool()
        daemon.engine.device_up(0)
        futures = []
        for i, text in enumerate(["a", "bad \ud800", "b"]):
            envelope = LocalEnvelope([f"client{i}".encode()])
            envelope.future = loop.create_future()
            futures.append(envelope.future)
            job = Job("echo", "standard", 1, 60_000, Pending(envelope, P.Request(i, "echo", text=text)))
            assert daemon.engine.submit(job, daemon.clock()) is None
        now[0] += 10_000_000                             # the 5 ms window has passed
        daemon._pump()                                   # the batch of three fails to encode
        bad = futures[1].result()
        assert bad.code == P.BAD_REQUEST and "cannot be encoded" in bad.message
        loop.run_until_complete(asyncio.sleep(0.01))     # the pass it asked for sends the rest
        [frames] = daemon.pool.sent
        batch = P.daemon_decoder.decode(frames[0])
        assert [item.text for item in batch.items] == ["a", "b"]
        [(_, held_at)] = daemon.engine.devices[0].held.values()   # the slot holds the new batch alone
        assert not futures[0].done() and not futures[2].done()
        result = P.BatchResult(batch.batch_id, 1000, None, ["a", "b"])
        daemon._on_result(0, result, [])
        assert [f.result().code for f in (futures[0], futures[2])] == [OK, OK]
        assert not daemon.engine.busy()
    finally:
        loop.close()


def test_a_given_up_device_is_probed_and_serves_again(tmp_path):
    """It used to stay given up for good: every later request answered unavailable."""
    daemon = start_daemon(tmp_path, ECHO, devices_extra="restart_limit = 0\nprobe_after_s = 0.5")
    try:
        with Client(daemon.endpoint) as client:
            # The worker dies; with no restart allowed the device is given up, and what was
            # waiting for it (the crash input's own rerun) is answered unavailable.
            [crashed] = outcomes([client.submit("echo", "crash", deadline_ms=60_000, timeout=60)])
            assert crashed == P.UNAVAILABLE, crashed.message
            assert "giving up on device cpu" in daemon.logs()
            wait_until(lambda: daemon.status()["daemon"]["state"] == "serving"
                       and daemon.status()["devices"][0]["state"] == "ready", 30,
                       message="the given-up device never came back")
            assert client.infer("echo", "after", deadline_ms=60_000, timeout=60) == "after"
        assert "probing device cpu" in daemon.logs()
        assert daemon.stop() == 0
    finally:
        daemon.kill()


def test_the_daemon_exits_1_when_every_device_stays_given_up(tmp_path):
    """So that the service manager (Restart=on-failure) restarts it; it used to serve
    `unavailable` for ever while systemd saw nothing wrong."""
    daemon = start_daemon(tmp_path, ECHO,
                          devices_extra="restart_limit = 0\nprobe_after_s = 600\ngive_up_exit_s = 0.5")
    try:
        with Client(daemon.endpoint) as client:
            [crashed] = outcomes([client.submit("echo", "crash", deadline_ms=60_000, timeout=60)])
            assert crashed == P.UNAVAILABLE
        assert daemon.proc.wait(30) == 1
        assert "every device has been given up for 0.5 s" in daemon.logs()
    finally:
        daemon.kill()


def test_a_device_back_within_give_up_exit_s_keeps_the_daemon_running(tmp_path):
    daemon = start_daemon(tmp_path, ECHO,
                          devices_extra="restart_limit = 0\nprobe_after_s = 0.2\ngive_up_exit_s = 1.5")
    try:
        with Client(daemon.endpoint) as client:
            assert outcomes([client.submit("echo", "crash", deadline_ms=60_000, timeout=60)]) == [P.UNAVAILABLE]
            gave_up = time.monotonic()
            wait_until(lambda: daemon.status()["daemon"]["state"] == "serving", 30,
                       message="the given-up device never came back")
            # Not a synchronisation: the exit timer must NOT fire, so its time is waited out.
            time.sleep(max(0.0, gave_up + 2.5 - time.monotonic()))
            assert daemon.proc.poll() is None and "every device has been given up" not in daemon.logs()
            assert client.infer("echo", "later", deadline_ms=60_000, timeout=60) == "later"
        assert daemon.stop() == 0
    finally:
        daemon.kill()
