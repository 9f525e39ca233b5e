"""`dynbatchctl forget USER`: a user erased from the top-users sketch (and its file), the result
cache and the warmup backlog; counts answered, the audit line keyed by the hash, never a payload."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import sys
from pathlib import Path

from dynbatchd import protocol as P
from dynbatchd.cache import ResultCache
from dynbatchd.client import Client
from dynbatchd.config import ChannelSettings
from dynbatchd.control.commands import COMMANDS, OPEN_TO_CLIENTS, TAKES_PEER, needs_admin
from dynbatchd.daemon_batches import Pending
from dynbatchd.engine import Engine, Job
from dynbatchd.pseudonyms import FILE_NAME as KEY_FILE, Pseudonyms
from dynbatchd.scheduler import build_channels
from dynbatchd.topusers import FILE_NAME, TopUsers
from conftest import start_daemon

MS = 1_000_000


# -- the parts, without a daemon ----------------------------------------------------------------
def test_the_sketch_forgets_a_user_of_every_tenant_or_of_one_and_says_what_it_kept():
    s = TopUsers(users=10, pseudonym=Pseudonyms(b"k" * 32))
    s.observe("a", "alice", "m", "alice in a")
    s.observe("b", "alice", "m", "alice in b")
    s.observe("a", "bob", "m", "bob's")
    key, erased = s.forget("alice", ("b",))
    assert erased == {"b": [("m", "alice in b")]} and s.count("alice", "a") == 1
    key, erased = s.forget("alice")
    assert key == Pseudonyms(b"k" * 32)("alice") and erased == {"a": [("m", "alice in a")]}
    assert s.count("alice", "a") == 0 and s.count("bob", "a") == 1
    assert s.forget("nobody") == (Pseudonyms(b"k" * 32)("nobody"), {})


def test_the_cache_discards_an_entry_without_counting_an_eviction():
    cache = ResultCache(10)
    cache.put(("m", None, "x"), 1, "always")
    assert cache.discard(("m", None, "x")) and ("m", None, "x") not in cache and cache.bytes == 0
    assert not cache.discard(("m", None, "x")) and cache.evictions == 0


def test_the_engine_drops_the_users_warmup_inputs_and_keeps_no_result_of_those_already_running():
    cache = ResultCache(100)
    e = Engine(build_channels({"bulk": ChannelSettings(max_batch=2, window_ms=10, deadline_ms=10_000,
                                                       queue_limit=4)}), ["d0"], inflight=1, cache=cache)
    e.device_up(0)
    e.channels["bulk"].cost.observe(2, 2, MS)   # a batch timed (1 ms): warmup batches of two fit its 10 ms window

    def warm(text):
        return Job("m", "bulk", 1, 0, Pending(None, P.Request(0, "m", text=text)), None, ("m", None, text))
    e.add_warmup([warm(t) for t in ("mine 1", "other 1", "mine 2", "other 2", "mine 3", "other 3")], "bulk")
    [dispatch], _ = e.step(0)   # two fed to the channel (half its queue), a batch of them running
    running = [job.cache_key[2] for job in dispatch.batch.items]
    assert running == ["mine 1", "other 1"]
    dropped = e.forget_warmup({("m", None, "mine 1"), ("m", None, "mine 2"), ("m", None, "mine 3")})
    assert [job.cache_key[2] for job in e.warmup_backlog] == ["other 2", "other 3"] and dropped == 2
    e.completed(0, dispatch.batch.id, _ok(dispatch.batch), MS)
    assert ("m", None, "mine 1") not in cache and ("m", None, "other 1") in cache


def _ok(batch):
    from dynbatchd.engine import Outcome
    return Outcome(MS, [0.0 for _ in batch.items])


def test_forget_is_an_admin_command_that_is_told_who_asks():
    assert "forget" in COMMANDS and "forget" not in OPEN_TO_CLIENTS and needs_admin("forget", {"user": "x"})
    assert "forget" in TAKES_PEER


# -- a live daemon -----------------------------------------------------------------------------------
DAEMON = """
    [models.sim]
    runner = "simulated"
    options = { base_ms = 1.0 }
    [channels.standard]
    max_batch = 8
    window_ms = 1
    [routing]
    default = "standard"
    [cache]
    entries = 100
    policy = "lru"
"""


def ctl(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name("dynbatchctl")), "--config", str(daemon.config),
                           *args], capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})


def test_forget_erases_the_user_from_sketch_file_and_cache_and_audits_only_the_hash(tmp_path):
    state = tmp_path / "state"
    daemon = start_daemon(tmp_path, DAEMON)
    try:
        with Client(daemon.endpoint) as client:
            for text in ("alice's diagnosis", "alice's diagnosis", "alice's address"):
                client.infer("sim", text, user="alice", tenant="clinic")
            client.infer("sim", "bob's question", user="bob", tenant="clinic")
        assert daemon.status()["cache"]["entries"] == 3
        done = ctl(daemon, "forget", "alice", "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"sketch_users": 1, "sketch_inputs": 2, "cache_entries": 2,
                                           "warmup_inputs": 0, "file_rewritten": True}
        saved = (state / FILE_NAME).read_bytes()   # rewritten at once, not at the next save
        assert b"alice" not in saved and b"bob's question" in saved
        key = hmac.new((state / KEY_FILE).read_bytes(), b"alice", hashlib.sha256).hexdigest()
        [line] = [json.loads(x) for x in (state / "audit.jsonl").read_text().splitlines()
                  if json.loads(x).get("rule") == "forget"]
        assert line["user"] == key and line["action"] == "erased" and line["by"] == "local"
        assert line["erased"]["cache_entries"] == 2
        assert "alice" not in (state / "audit.jsonl").read_text() and "alice" not in daemon.logs()
        with Client(daemon.endpoint) as client:   # her inputs are computed again; bob's still cached
            assert client.infer_result("sim", "alice's diagnosis", tenant="clinic").timing.device != "cache"
            assert client.infer_result("sim", "bob's question", tenant="clinic").timing.device == "cache"
        again = ctl(daemon, "forget", "alice")
        assert again.returncode == 0 and again.stdout.startswith("erased 0 user record(s)")
    finally:
        daemon.stop()
