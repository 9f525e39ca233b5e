"""The top-users sketch against exact counts, and its state file."""

from __future__ import annotations

import os
import random
from collections import Counter

from dynbatchd.topusers import TopUsers


def zipf_stream(n: int, users: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    weights = [1.0 / (rank ** 1.1) for rank in range(1, users + 1)]
    return [f"u{i}" for i in rng.choices(range(users), weights=weights, k=n)]


def test_the_heaviest_users_are_found_and_counted_within_the_floor():
    stream = zipf_stream(100_000, users=20_000)
    sketch = TopUsers(users=500)
    for user in stream:
        sketch.observe(None, user, "m", f"text of {user}")
    exact = Counter(stream)
    true_top = [u for u, _ in exact.most_common(100)]
    found = [user for _, user, _, _ in sketch.top(100)]
    # Every user more active than the floor is kept; the top 100 are far above it.
    assert exact[true_top[-1]] > sketch.floor
    assert len(set(found) & set(true_top)) >= 95
    for _, user, count, _ in sketch.top(100):
        assert exact[user] <= count <= exact[user] + sketch.floor   # never under, over by at most the floor


def test_each_user_keeps_their_most_frequent_inputs():
    sketch = TopUsers(users=10, inputs_per_user=2)
    for text, times in (("often", 9), ("sometimes", 5), ("once", 1), ("twice", 2)):
        for _ in range(times):
            sketch.observe("t", "alice", "m", text)
    [(tenant, user, count, inputs)] = list(sketch.top(1))
    assert (tenant, user, count) == ("t", "alice", 17)
    assert inputs == [("m", "often"), ("m", "sometimes")]


def test_tenants_are_counted_apart():
    sketch = TopUsers(users=10)
    sketch.observe("a", "bob", "m", "x")
    sketch.observe("b", "bob", "m", "y")
    assert sketch.count("bob", "a") == 1 and sketch.count("bob", "b") == 1 and len(sketch) == 2


def test_save_and_load_round_trip_owner_only(tmp_path):
    sketch = TopUsers(users=100)
    for user in zipf_stream(2_000, users=300):
        sketch.observe(None, user, "m", "t " + user)
    path = tmp_path / "top-users.msgpack"
    sketch.save(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    again = TopUsers.load(path, users=100)
    assert list(again.top(20)) == list(sketch.top(20)) and again.observed == sketch.observed


def test_a_corrupt_or_missing_file_starts_a_new_sketch(tmp_path, caplog):
    path = tmp_path / "top-users.msgpack"
    assert len(TopUsers.load(path)) == 0
    path.write_bytes(b"\x93not msgpack of the right shape secret-payload")
    with caplog.at_level("WARNING"):
        assert len(TopUsers.load(path)) == 0
    assert "unreadable" in caplog.text and "secret-payload" not in caplog.text


def test_a_newcomer_that_triggers_the_prune_is_still_counted():
    sketch = TopUsers(users=4)
    for i in range(5):                      # 5 = 4 x SLACK users held: the next newcomer prunes first
        sketch.observe(None, f"u{i}", "m", "x")
    sketch.observe(None, "newcomer", "m", "hello")
    assert sketch.count("newcomer") == sketch.floor + 1 and len(sketch) <= 5
    assert ("m", "hello") in dict(((t, u), i) for t, u, _, i in sketch.top(10))[(None, "newcomer")]
