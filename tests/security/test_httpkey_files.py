"""The HTTP door reads a key's file on the event loop at each request: a file that never ends
(a link to /dev/zero), one that blocks (a FIFO) or a huge one must be refused, not read. The key
is refused (the door answers 401) and the file logged once, by name, never by its content."""

from __future__ import annotations

import logging
import os
import threading

from dynbatchd import httpkeys


def store_with_key(tmp_path, name: str = "k2"):
    key = httpkeys.create(tmp_path, name, "acme")
    return httpkeys.KeyStore(tmp_path), key, httpkeys.keys_dir(tmp_path) / f"{name}.hash"


def check_within(store, key: str, seconds: float = 10.0):
    """`store.check(key)` run in a thread: a read that blocks fails the test instead of hanging it."""
    answer: list = []
    worker = threading.Thread(target=lambda: answer.append(store.check(key)), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), "the key check blocked on the key file"
    return answer[0]


def test_a_good_key_and_a_link_to_its_regular_file_are_accepted(tmp_path):
    store, key, path = store_with_key(tmp_path)
    assert store.check(key).tenant == "acme"
    moved = tmp_path / "elsewhere.hash"
    os.replace(path, moved)
    path.symlink_to(moved)   # a link to a regular file is still a key file
    assert store.check(key).tenant == "acme"


def test_a_link_to_a_device_is_refused_unread_and_logged_once(tmp_path, caplog):
    store, key, path = store_with_key(tmp_path)
    path.unlink()
    path.symlink_to("/dev/null")
    with caplog.at_level(logging.WARNING, logger="dynbatchd.httpkeys"):
        assert check_within(store, key) is None
        assert check_within(store, key) is None
    refusals = [r for r in caplog.records if "k2.hash" in r.getMessage()]
    assert len(refusals) == 1 and "not a regular file" in refusals[0].getMessage()


def test_a_fifo_does_not_block_the_door(tmp_path):
    store, key, path = store_with_key(tmp_path)
    path.unlink()
    os.mkfifo(path)   # nobody writes it: a blocking open would wait for ever
    assert check_within(store, key) is None
    assert httpkeys.read_all(path.parent) == {}


def test_a_file_past_the_bound_is_refused_even_when_its_record_is_valid(tmp_path, caplog):
    store, key, path = store_with_key(tmp_path)
    record = path.read_bytes().rstrip()
    path.write_bytes(record + b" " * httpkeys.MOST_BYTES)   # valid JSON, padded past 64 KiB
    with caplog.at_level(logging.WARNING, logger="dynbatchd.httpkeys"):
        assert store.check(key) is None
    assert "larger than 64 KiB" in caplog.text
    assert record.decode() not in caplog.text   # the content is never logged
    path.write_bytes(record + b"\n")   # back to a small file: the key works again
    assert store.check(key).tenant == "acme"

