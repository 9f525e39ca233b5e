"""The top-users sketch keeps a bounded number of bytes of text: a live fuzzing pass left 220 MiB in
memory and a 200 MB state file after 200 users sent 1 MiB each. A text over the per-text limit is
counted but not kept; the texts kept stay within the total budget, the most asked surviving; a file
saved under larger bounds is cut at load; warmup still reads what is kept."""

from __future__ import annotations

import itertools

from dynbatchd.topusers import TopUsers
from dynbatchd_plugins.warmup import observed_jobs

MIB = 1 << 20


def held_bytes(sketch: TopUsers) -> int:
    """The UTF-8 bytes of every text the sketch keeps."""
    return sum(len(text.encode()) for _, _, _, inputs in sketch.top(len(sketch)) for _, text in inputs)


def test_the_fuzzers_case_a_mebibyte_text_per_user_is_counted_but_not_kept(tmp_path):
    sketch = TopUsers()   # the daemon's defaults
    for i in range(200):
        sketch.observe(None, f"user{i}", "m", f"{i:04d}" + "x" * MIB)
    sketch.observe(None, "user0", "m", "short question")
    assert len(sketch) == 200 and sketch.count("user0") == 2   # every request still counted
    assert held_bytes(sketch) == len("short question")
    path = tmp_path / "top-users.msgpack"
    sketch.save(path)
    assert path.stat().st_size < 64 << 10   # was 200 MB


def test_a_non_ascii_text_is_measured_in_utf8_bytes():
    sketch = TopUsers(max_text_bytes=100)
    sketch.observe(None, "a", "m", "é" * 60)   # 60 characters, 120 bytes
    sketch.observe(None, "b", "m", "é" * 50)   # 100 bytes: kept
    assert {user: inputs for _, user, _, inputs in sketch.top(2)} == {"a": [], "b": [("m", "é" * 50)]}


def test_the_texts_kept_stay_within_the_budget_and_the_most_asked_survive():
    budget, size = 20_000, 900
    sketch = TopUsers(users=1000, inputs_per_user=2, max_text_bytes=1000, text_budget=budget,
                      clock=itertools.count(1).__next__)   # a second a request: ages differ
    for _ in range(5):   # one favourite, asked often, early
        sketch.observe(None, "fan", "m", "F" * size)
    for i in range(300):
        sketch.observe(None, f"u{i}", "m", f"{i:05d}".ljust(size, "y"))
        assert held_bytes(sketch) <= budget
    assert held_bytes(sketch) >= budget * 0.5   # dropped down to its low-water mark, not emptied
    kept = {user: inputs for _, user, _, inputs in sketch.top(len(sketch))}
    assert kept["fan"] == [("m", "F" * size)]
    assert kept["u299"] and not kept["u0"]   # among texts asked once, the oldest went first
    assert len(sketch) == 301 and sum(c for _, _, c, _ in sketch.top(len(sketch))) == 305


def test_a_file_saved_under_larger_bounds_is_cut_at_load_and_warmup_still_reads_it(tmp_path):
    path = tmp_path / "top-users.msgpack"
    loose = TopUsers(max_text_bytes=4 * MIB, text_budget=1 << 30)
    for i in range(20):
        loose.observe(None, f"big{i}", "m", f"{i:03d}" + "z" * (2 * MIB))
        for _ in range(2):
            loose.observe(None, f"small{i}", "m", f"what is {i}?")
    loose.save(path)
    assert path.stat().st_size > 40 * MIB

    loaded = TopUsers.load(path)
    assert held_bytes(loaded) == sum(len(f"what is {i}?") for i in range(20))
    assert loaded.count("big3") == 1 and loaded.count("small3") == 2
    tight = TopUsers.load(path, max_text_bytes=100, text_budget=60)
    assert held_bytes(tight) <= 60

    jobs = observed_jobs(path, "m", top_users=40)   # the warmup plugin loads the file with the defaults
    assert sorted(jobs[0].inputs) == sorted(f"what is {i}?" for i in range(20))
