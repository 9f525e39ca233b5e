"""The bundled MiniLM model served end to end, and many clients at once."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import zmq
import zmq.asyncio

from dynbatchd import protocol as P
from dynbatchd.client import AsyncClient, BadRequest, Client, build_request


def test_real_embeddings_are_384_normalised_floats_with_meaning(minilm_daemon):
    with Client(minilm_daemon.endpoint) as client:
        texts = ["A man is playing a guitar.", "Someone strums a guitar.", "The stock market fell sharply today."]
        a, b, c = (client.infer("minilm", t) for t in texts)
    assert a.shape == (384,) and a.dtype == np.float32
    assert abs(float(np.linalg.norm(a)) - 1.0) < 1e-4
    assert float(a @ b) > float(a @ c) + 0.2   # paraphrases are closer than unrelated sentences


def test_input_the_model_cannot_take_is_bad_request_and_harms_no_one(minilm_daemon):
    with Client(minilm_daemon.endpoint) as client:
        bad = client.submit("minilm", [1, 2, 3])          # a plain value: this model takes text
        good = client.submit("minilm", "fine text")
        with pytest.raises(BadRequest, match="text"):
            bad.result(timeout=60)
        assert good.result(timeout=60).output.shape == (384,)


def test_a_text_longer_than_the_model_reads_is_costed_at_what_it_reads(minilm_daemon):
    # MiniLM reads a text's first 256 tokens. A 400 KB text is ~100k tokens by its size: costed in
    # full, a settled cost (0.1-0.2 ms a token on a CPU) called it hopeless within 2 s and it was
    # refused at once as deadline_exceeded; it runs in well under a second.
    with Client(minilm_daemon.endpoint) as client:
        for i in range(30):   # one at a time, of 5 to 200 words: 30 batches timed, its cost per token learned
            client.infer("minilm", "word " * (5, 20, 60, 120, 200)[i % 5])
        assert minilm_daemon.status()["channels"]["standard"]["cost_ms"]["samples"] >= 20
        long = client.infer_result("minilm", "many words here " * 25_000, deadline_ms=2000)
        assert long.output.shape == (384,)


def test_dynbatchctl_infer_prints_embedding_and_timing(minilm_daemon):
    out = subprocess.run([str(Path(sys.executable).parent / "dynbatchctl"), "--endpoint", minilm_daemon.endpoint,
                          "infer", "minilm", "some text", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["output"]) == 384
    assert data["timing"]["batch_size"] >= 1 and data["timing"]["compute_ms"] > 0
    assert data["timing"]["simulated"] is False


async def _one_client(endpoint: str, client_no: int, count: int) -> list[tuple[int, P.Reply]]:
    """Raw DEALER: all requests in flight at once, replies matched by id afterwards."""
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    ids = [client_no * 100_000 + i for i in range(count)]
    for rid in ids:
        await sock.send_multipart(build_request(rid, "minilm", f"client {client_no} sentence number {rid % 97}"))
    replies = []
    while len(replies) < count:
        if not await sock.poll(60_000):
            break
        frames = await sock.recv_multipart()
        replies.append((client_no, P.reply_decoder.decode(frames[0])))
    # Any extra (duplicate) reply would arrive now.
    while await sock.poll(200):
        frames = await sock.recv_multipart()
        replies.append((client_no, P.reply_decoder.decode(frames[0])))
    sock.close()
    return replies


def test_2000_requests_from_8_clients_answered_exactly_once_in_real_batches(minilm_daemon):
    async def run():
        return await asyncio.gather(*(_one_client(minilm_daemon.endpoint, c, 250) for c in range(8)))

    per_client = asyncio.run(run())
    for client_no, replies in enumerate(per_client):
        ids = Counter(r.id for _, r in replies)
        assert sorted(ids) == [client_no * 100_000 + i for i in range(250)], "a client got someone else's or lost replies"
        assert set(ids.values()) == {1}, "a request was answered twice"
        assert all(r.ok for _, r in replies), Counter(r.error.code + ": " + r.error.message[:80] for _, r in replies if not r.ok)
    sizes = [r.timing.batch_size for replies in per_client for _, r in replies]
    assert max(sizes) > 1


def test_async_client_many_in_flight(minilm_daemon):
    async def run():
        async with AsyncClient(minilm_daemon.endpoint) as client:
            return await asyncio.gather(*(client.infer("minilm", f"text {i}") for i in range(20)))

    outs = asyncio.run(run())
    assert len(outs) == 20 and all(o.shape == (384,) for o in outs)
