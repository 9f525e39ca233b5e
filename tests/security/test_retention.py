"""Data minimisation in the top-users sketch, against a fake clock: texts and users expire after
[top_users] retain_days, and users are kept only as a keyed hash of their id."""

from __future__ import annotations

import hashlib
import hmac
import os

import msgspec
import pytest

from dynbatchd import config as cfgmod
from dynbatchd.pseudonyms import FILE_NAME as KEY_FILE, Pseudonyms
from dynbatchd.topusers import DAY_S, FILE_NAME, TopUsers


class Clock:
    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def days(self, n: float) -> None:
        self.now += n * DAY_S


def sketch(clock: Clock, pseudonym=None, **kw) -> TopUsers:
    return TopUsers(users=100, inputs_per_user=4, retain_days=30, clock=clock,
                    pseudonym=pseudonym or Pseudonyms(b"k" * 32), **kw)


def texts(s: TopUsers) -> dict[str, list[str]]:
    return {user: [text for _, text in inputs] for _, user, _, inputs in s.top(100)}


# -- retention -------------------------------------------------------------------------------
def test_a_text_not_asked_for_retain_days_is_dropped_on_observe():
    clock = Clock()
    s = sketch(clock)
    s.observe("t", "alice", "m", "old text")
    clock.days(20)
    s.observe("t", "alice", "m", "newer text")
    clock.days(11)                                   # old text: 31 days; newer: 11
    s.observe("t", "bob", "m", "anything")           # any request sweeps (at most hourly)
    [alice_key] = [u for _, u, c, _ in s.top(10) if c == 2]
    assert texts(s)[alice_key] == ["newer text"]
    assert s.count("alice", "t") == 2                # still seen within 30 days: counted


def test_asking_again_keeps_a_text():
    clock = Clock()
    s = sketch(clock)
    for _ in range(3):
        s.observe(None, "alice", "m", "daily")
        clock.days(25)
    assert [t for _, _, _, inputs in s.top(1) for _, t in inputs] == ["daily"]


def test_a_user_not_seen_for_retain_days_is_dropped_count_and_all():
    clock = Clock()
    s = sketch(clock)
    s.observe(None, "gone", "m", "x")
    clock.days(29)
    s.observe(None, "stays", "m", "y")
    clock.days(2)
    s.expire()
    assert s.count("gone") == 0 and s.count("stays") == 1 and len(s) == 1


def test_save_drops_what_expired_and_load_drops_what_expired_since(tmp_path):
    clock = Clock()
    key = Pseudonyms(b"k" * 32)
    s = sketch(clock, key)
    s.observe(None, "alice", "m", "first")
    clock.days(31)
    s.observe(None, "bob", "m", "second")
    s.save(tmp_path / FILE_NAME)
    saved = (tmp_path / FILE_NAME).read_bytes()
    assert b"first" not in saved and b"second" in saved
    clock.days(31)                                   # the file is read back a month later
    again = TopUsers.load(tmp_path / FILE_NAME, 100, 4, pseudonym=key, retain_days=30, clock=clock)
    assert len(again) == 0 and again.observed == 2


BASE = {"models": {"m": {"runner": "simulated"}}, "channels": {"standard": {"max_batch": 8, "window_ms": 1}}}


def test_retain_days_is_a_config_key_with_a_default():
    assert cfgmod.parse(BASE).top_users.retain_days == 30.0
    assert cfgmod.parse({**BASE, "top_users": {"retain_days": 7}}).top_users.retain_days == 7
    with pytest.raises(cfgmod.ConfigError):
        cfgmod.parse({**BASE, "top_users": {"retain_days": 0}})


# -- keyed hashes ------------------------------------------------------------------------------
def test_user_ids_are_kept_only_as_their_keyed_hash(tmp_path):
    secret = b"s" * 32
    s = sketch(Clock(), Pseudonyms(secret))
    s.observe("t", "alice@example.com", "m", "text")
    s.save(tmp_path / FILE_NAME)
    saved = (tmp_path / FILE_NAME).read_bytes()
    expected = hmac.new(secret, b"alice@example.com", hashlib.sha256).hexdigest()
    assert b"alice" not in saved and expected.encode() in saved
    assert [u for _, u, _, _ in s.top(1)] == [expected]
    assert s.count("alice@example.com", "t") == 1      # found again by its name
    assert expected != hashlib.sha256(b"alice@example.com").hexdigest()   # keyed, not a plain hash


def test_the_key_is_created_owner_only_once_and_read_back(tmp_path):
    path = tmp_path / KEY_FILE
    first = Pseudonyms.load(path)
    assert os.stat(path).st_mode & 0o777 == 0o600 and len(path.read_bytes()) == 32
    assert Pseudonyms.load(path)("bob") == first("bob")
    os.chmod(path, 0o644)
    Pseudonyms.load(path)
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_a_sketch_hashed_under_another_key_starts_afresh(tmp_path, caplog):
    clock = Clock()
    s = sketch(clock, Pseudonyms(b"a" * 32))
    s.observe(None, "alice", "m", "text")
    s.save(tmp_path / FILE_NAME)
    with caplog.at_level("WARNING"):
        again = TopUsers.load(tmp_path / FILE_NAME, pseudonym=Pseudonyms(b"b" * 32), clock=clock)
    assert len(again) == 0 and "another user-id key" in caplog.text


class FirstFormat(msgspec.Struct):
    format: int
    observed: int
    floor: int
    users: list


def test_an_old_sketch_with_plain_ids_is_converted_ids_hashed_texts_dropped(tmp_path, caplog):
    path = tmp_path / FILE_NAME
    path.write_bytes(msgspec.msgpack.encode(FirstFormat(1, 7, 0, [
        ["t", "alice", 5, 0, [["m", "alice's old text", 5]]],
        [None, "bob", 2, 0, []],
    ])))
    key = Pseudonyms(b"k" * 32)
    with caplog.at_level("INFO"):
        s = TopUsers.load(path, 100, 4, pseudonym=key, clock=Clock())
    assert s.count("alice", "t") == 5 and s.count("bob") == 2 and s.observed == 7
    assert texts(s) == {key("alice"): [], key("bob"): []}
    assert "converted" in caplog.text and "alice" not in caplog.text
    s.save(path)
    saved = path.read_bytes()
    assert b"alice" not in saved and b"old text" not in saved
