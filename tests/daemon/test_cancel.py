"""Cancellation end to end: a queued request withdrawn by its client is answered `cancelled`."""

from __future__ import annotations

import asyncio

import msgspec
import zmq

from conftest import start_daemon

from dynbatchd import protocol as P
from dynbatchd.client import AsyncClient, Timeout

SLOW = """
    [models.sim]
    runner = "simulated"
    options = { base_ms = 300.0 }
    [channels.standard]
    max_batch = 1
    window_ms = 0
    deadline_ms = 60000
    [routing]
    default = "standard"
"""


def start(tmp_path):
    return start_daemon(tmp_path, SLOW, devices_extra="inflight = 1")


def test_cancel_answers_a_queued_request_cancelled_and_lets_the_running_one_finish(tmp_path):
    daemon = start(tmp_path)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    try:
        for rid in (1, 2, 3):   # 1 runs (300 ms), 2 and 3 wait behind it
            sock.send(msgspec.msgpack.encode({"id": rid, "model": "sim", "text": "x"}))
        sock.send(msgspec.msgpack.encode({"id": 3, "cancel": True}))
        sock.send(msgspec.msgpack.encode({"id": 99, "cancel": True}))   # unknown: no answer at all
        replies = {}
        while len(replies) < 3 and sock.poll(20_000):
            reply = P.reply_decoder.decode(sock.recv_multipart()[0])
            assert reply.id not in replies, "answered twice"
            replies[reply.id] = reply
        assert replies[1].ok and replies[2].ok
        assert not replies[3].ok and replies[3].error.code == P.CANCELLED
        assert not sock.poll(500)                          # nothing for the unknown id, nothing twice
        assert daemon.status()["channels"]["standard"]["cancelled"] == 1
    finally:
        sock.close()
        daemon.stop()


def test_the_client_cancels_what_timed_out(tmp_path):
    daemon = start(tmp_path)

    async def run():
        async with AsyncClient(daemon.endpoint, timeout=0.05) as client:
            first = asyncio.ensure_future(client.infer("sim", "a", timeout=10))
            await asyncio.sleep(0.01)   # let the first reach the device before the second queues
            try:
                await client.infer("sim", "b")
            except Timeout:
                pass
            return await first
    try:
        assert asyncio.run(run()) is not None
        assert daemon.status()["channels"]["standard"]["cancelled"] == 1
    finally:
        daemon.stop()
