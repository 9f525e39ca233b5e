"""Data minimisation: the top-users sketch keeps input texts only where the result cache is on (warmup
can use them only there); otherwise it counts requests per user and keeps no text."""

from __future__ import annotations

import asyncio

from conftest import SIMULATED, start_daemon
from dynbatchd.client import AsyncClient
from dynbatchd.pseudonyms import FILE_NAME as KEY_FILE, Pseudonyms
from dynbatchd.topusers import FILE_NAME, TopUsers


def test_a_sketch_without_inputs_counts_users_and_keeps_no_text(tmp_path):
    sketch = TopUsers(users=10, inputs_per_user=0)
    for _ in range(3):
        sketch.observe("t", "alice", "m", "a private text")
    assert sketch.count("alice", "t") == 3
    assert list(sketch.top(1)) == [("t", "alice", 3, [])]
    sketch.save(tmp_path / FILE_NAME)
    assert b"a private text" not in (tmp_path / FILE_NAME).read_bytes()


def test_texts_saved_before_are_dropped_when_loaded_without_inputs(tmp_path):
    kept = TopUsers(users=10, inputs_per_user=4)
    kept.observe(None, "bob", "m", "an older text")
    kept.save(tmp_path / FILE_NAME)
    sketch = TopUsers.load(tmp_path / FILE_NAME, users=10, inputs_per_user=0)
    assert sketch.count("bob") == 1 and list(sketch.top(1)) == [(None, "bob", 1, [])]
    sketch.save(tmp_path / FILE_NAME)
    assert b"an older text" not in (tmp_path / FILE_NAME).read_bytes()


def test_a_daemon_with_the_cache_off_saves_no_input_text(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED)   # [cache] entries = 0: the default

    async def send():
        async with AsyncClient(daemon.endpoint) as client:
            for i in range(5):
                await client.infer("sim", f"my private words {i}", user="carol")
    try:
        asyncio.run(send())
    finally:
        daemon.stop()   # saves the sketch
    saved = (tmp_path / "state" / FILE_NAME).read_bytes()
    carol = Pseudonyms.load(tmp_path / "state" / KEY_FILE)("carol")   # counted under her keyed hash only
    assert carol.encode() in saved and b"carol" not in saved and b"my private words" not in saved
