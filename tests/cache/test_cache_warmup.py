"""Result cache and warmup: the top users' inputs are precomputed, then served from the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dynbatchd.cache import ResultCache
from dynbatchd.client import Client
from dynbatchd_plugins.warmup import top_user_inputs
from conftest import start_daemon
from helpers import wait_until


def test_cache_is_bounded_and_least_recently_used_goes_first():
    cache = ResultCache(2)
    cache.put(("m", "a"), 1)
    cache.put(("m", "b"), 2)
    assert cache.get(("m", "a")) == 1      # a is now the most recently used
    cache.put(("m", "c"), 3)
    assert ("m", "b") not in cache and ("m", "a") in cache and len(cache) == 2
    assert cache.snapshot()["hits"] == 1


def test_top_users_are_ranked_by_activity(tmp_path):
    source = tmp_path / "users.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in [
        {"user": "light", "requests": 2, "text": "rarely"},
        {"user": "heavy", "requests": 90, "text": "often one"},
        {"user": "heavy", "requests": 10, "text": "often two"},
        {"user": "mid", "requests": 50, "text": "sometimes"},
    ]) + "\nnot json\n")
    assert top_user_inputs(source, 2) == ["often one", "often two", "sometimes"]


def test_warmup_fills_the_cache_and_requests_are_served_from_it(tmp_path):
    source = tmp_path / "users.jsonl"
    source.write_text("\n".join(json.dumps({"user": f"u{i}", "requests": 100 - i, "text": f"profile of user {i}"})
                                for i in range(10)))
    daemon = start_daemon(tmp_path, f"""
        [models.sim]
        runner = "simulated"
        options = {{ base_ms = 1.0 }}
        [channels.standard]
        max_batch = 8
        window_ms = 2
        [channels.bulk]
        max_batch = 4
        window_ms = 5
        [routing]
        default = "standard"
        [cache]
        entries = 100
        warmup_channel = "bulk"
        [plugins.warmup]
        source = "{source}"
    """)
    try:
        queued = daemon.call("warmup", top_users=3)
        assert queued == {"queued": 3, "already_cached": 0, "backlog": 3, "channel": "bulk"}
        wait_until(lambda: daemon.status()["cache"]["entries"] >= 3, 30, message="warmup did not finish")
        bulk = daemon.status()["channels"]["bulk"]
        assert bulk["warmup"]["batches"] >= 1 and bulk["warmup"]["items"] == 3   # it ran in the warmup channel
        assert bulk["batches"] == 0 and bulk["fill_rate"] == 0       # and is kept out of the live figures
        with Client(daemon.endpoint) as client:
            hit = client.infer_result("sim", "profile of user 0")
            miss = client.infer_result("sim", "profile of user 9")
        assert hit.timing.device == "cache" and hit.timing.batch_size == 0
        assert hit.output.tolist() == [len("profile of user 0"), 5.0]
        standard = daemon.status()["channels"]["standard"]
        assert standard["cache_hits"] == 1 and standard["completed"] == 1   # a hit is not a 0 ms completion
        assert miss.timing.device == "cpu"
        assert daemon.call("warmup", top_users=3)["already_cached"] == 3
    finally:
        daemon.stop()


WARMUP_DAEMON = """
    [models.sim]
    runner = "simulated"
    options = {{ base_ms = 1.0 }}
    [channels.standard]
    max_batch = 8
    window_ms = 2
    [channels.bulk]
    max_batch = 4
    window_ms = 5
    [routing]
    default = "standard"
    [cache]
    entries = 100
    warmup_channel = "bulk"
    {extra}
"""


def ctl_warmup(daemon, *args: str) -> subprocess.CompletedProcess:
    """`dynbatchctl warmup` as an operator (or the nightly timer) runs it, against this daemon."""
    return subprocess.run([str(Path(sys.executable).with_name("dynbatchctl")), "--config", str(daemon.config),
                           "warmup", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200"})


def test_warmup_refuses_until_users_are_observed_then_warms_their_inputs(tmp_path):
    state = tmp_path / "state"
    daemon = start_daemon(tmp_path, WARMUP_DAEMON.format(extra=""), daemon_extra=f'state_dir = "{state}"')
    try:
        refused = ctl_warmup(daemon, "--top-users", "10000")
        assert refused.returncode == 1
        assert "observed no request with a user" in refused.stderr + refused.stdout
        with Client(daemon.endpoint) as client:
            for i in range(3):                       # user 0 asks 3 times, user 1 twice, user 2 once
                for _ in range(3 - i):
                    client.infer("sim", f"feed of user {i}", user=f"u{i}")
            client.infer("sim", "anonymous")       # no user: not counted
        standard = daemon.status()["channels"]["standard"]     # each call above waited for its answer
        assert standard["completed"] + standard["cache_hits"] == 7
        before = daemon.status()["cache"]["entries"]
        done = ctl_warmup(daemon, "--top-users", "2", "--json", "--wait")
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        # the two most active users' inputs; those already cached by live traffic are not run again
        assert answer["queued"] + answer["already_cached"] == 2 and answer["warmed"] == answer["queued"]
        assert daemon.status()["cache"]["entries"] >= before
        assert (state / "top-users.msgpack").is_file()   # saved before the plugin read it
    finally:
        daemon.stop()


def test_warmup_refuses_with_the_sketch_off(tmp_path):
    daemon = start_daemon(tmp_path, WARMUP_DAEMON.format(extra="[top_users]\nusers = 0"),
                          daemon_extra=f'state_dir = "{tmp_path / "state"}"')
    try:
        answer = daemon.call("warmup", top_users=10)
        assert answer["queued"] == 0 and "[top_users] users = 0" in answer["reason"]
        refused = ctl_warmup(daemon)
        assert refused.returncode == 1 and "users = 0" in refused.stderr + refused.stdout
    finally:
        daemon.stop()


def test_warmup_refuses_an_empty_source_file(tmp_path):
    source = tmp_path / "users.jsonl"
    source.write_text("")
    daemon = start_daemon(tmp_path, WARMUP_DAEMON.format(extra=f'[plugins.warmup]\nsource = "{source}"'),
                          daemon_extra=f'state_dir = "{tmp_path / "state"}"')
    try:
        answer = daemon.call("warmup", top_users=10)
        assert answer["queued"] == 0 and str(source) in answer["reason"]
        refused = ctl_warmup(daemon, "--json")
        assert refused.returncode == 1 and json.loads(refused.stdout)["reason"] == answer["reason"]
    finally:
        daemon.stop()
