"""Faults a fuzzing pass found in warmup and the top-users file.

- ``warmup`` with no model queued the inputs of models that had failed to load after a reload
  (they ran to no effect and were counted as warmed). Now skipped, and the answer says which and why.
- A directory in place of ``top-users.msgpack``: "is unreadable (IsADirectoryError)" was logged at
  the daemon's start and again at each warmup, once per model (the built-in warmup plugin reads the
  file), and every save interval logged the failed save again. Now one line each.
"""

from __future__ import annotations

import logging
import textwrap
from types import SimpleNamespace

from dynbatchd import config as cfgmod
from dynbatchd.cache_operations import CacheOperations
from dynbatchd.hookspecs import WarmupJob
from dynbatchd.plugins import Plugins
from dynbatchd.topusers import FILE_NAME, TopUsers


def config(tmp_path, models=("a", "b")) -> cfgmod.Config:
    text = "".join(f'[models.{m}]\nrunner = "noop"\n' for m in models) + textwrap.dedent(f"""
        [channels.standard]
        max_batch = 8
        window_ms = 10
        [cache]
        entries = 100
        [daemon]
        state_dir = "{tmp_path}"
    """)
    path = tmp_path / "c.toml"
    path.write_text(text)
    return cfgmod.load(path)


class FakeEngine:
    def __init__(self):
        self.queued: list = []

    def add_warmup(self, jobs, channel):
        jobs = list(jobs)
        self.queued += jobs
        return len(jobs), 0

    def warmup_waiting(self) -> int:
        return len(self.queued)


class AskedPlugins:
    """Names one input of every model it is asked about, and remembers who asked."""

    def __init__(self):
        self.asked: list[str] = []

    def warmup_jobs(self, model, top_users, config):
        self.asked.append(model)
        return [WarmupJob(model, [f"input of {model}"])]


def fake_daemon(cfg, failed=(), plugins=None, top_users=None):
    failed = {m: f"model {m!r} failed to load: no worker could load it" for m in failed}
    return SimpleNamespace(config=cfg, cache=object(), engine=FakeEngine(), plugins=plugins or AskedPlugins(),
                           membership=SimpleNamespace(unready=failed.get), top_users=top_users,
                           _top_users_saved=0, _schedule_pump=lambda: None)


# -- warmup of every model ---------------------------------------------------------

def test_warmup_of_every_model_skips_one_that_failed_to_load_and_says_why(tmp_path):
    daemon = fake_daemon(config(tmp_path), failed=["b"])
    answer = CacheOperations(daemon).warmup(None, 10)
    assert daemon.plugins.asked == ["a"]
    assert [job.model for job in daemon.engine.queued] == ["a"]
    assert answer["queued"] == 1 and answer["skipped"] == {"b": "model 'b' failed to load: no worker could load it"}
    assert {"queued", "already_cached", "backlog", "channel"} <= set(answer)


def test_warmup_with_every_model_ready_has_no_skipped_key(tmp_path):
    daemon = fake_daemon(config(tmp_path))
    answer = CacheOperations(daemon).warmup(None, 10)
    assert daemon.plugins.asked == ["a", "b"] and "skipped" not in answer


def test_warmup_with_no_model_ready_says_so_as_its_reason(tmp_path):
    daemon = fake_daemon(config(tmp_path), failed=["a", "b"])
    answer = CacheOperations(daemon).warmup(None, 10)
    assert daemon.plugins.asked == [] and answer["queued"] == 0
    assert answer["reason"].startswith("no model is ready: model 'a' failed to load")
    assert set(answer["skipped"]) == {"a", "b"}


# -- a directory in place of the top-users file -------------------------------------

def unreadable_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "is unreadable" in r.getMessage()]


def test_an_unreadable_top_users_file_is_logged_once_however_often_it_is_loaded(tmp_path, caplog):
    (tmp_path / FILE_NAME).mkdir()
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert len(TopUsers.load(tmp_path / FILE_NAME)) == 0
    assert len(unreadable_lines(caplog)) == 1 and "IsADirectoryError" in unreadable_lines(caplog)[0]


def test_a_top_users_file_that_breaks_again_after_a_good_read_is_logged_again(tmp_path, caplog):
    path = tmp_path / FILE_NAME
    with caplog.at_level(logging.WARNING):
        path.write_bytes(b"\xc1 not msgpack")
        TopUsers.load(path)
        TopUsers(users=10).save(path)
        TopUsers.load(path)   # read fine: the next problem is news
        path.write_bytes(b"\xc1 not msgpack")
        TopUsers.load(path)
    assert len(unreadable_lines(caplog)) == 2


def test_a_daemon_run_with_a_directory_for_the_top_users_file_logs_it_once(tmp_path, caplog):
    """The daemon's start, then a warmup of two models through the built-in plugin (which reads the
    file once per model), then saves at three intervals: one warning, one error."""
    (tmp_path / FILE_NAME).mkdir()
    cfg = config(tmp_path)
    with caplog.at_level(logging.WARNING):
        daemon = fake_daemon(cfg, plugins=Plugins.load())
        ops = CacheOperations(daemon)
        daemon.top_users = ops.load_top_users(cfg)
        daemon.top_users.observe(None, "bob", "a", "hello")
        ops.warmup(None, 10)
        for n in range(3):
            daemon.top_users.observe(None, f"user {n}", "a", "hello")
            ops.save_top_users()
    assert len(unreadable_lines(caplog)) == 1
    saves = [r.getMessage() for r in caplog.records if "could not save the top-users sketch" in r.getMessage()]
    assert len(saves) == 1 and "Is a directory" in saves[0], saves
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")] == []


def test_a_save_that_works_again_is_logged_and_the_next_failure_too(tmp_path, caplog):
    path = tmp_path / FILE_NAME
    path.mkdir()
    cfg = config(tmp_path)
    daemon = fake_daemon(cfg, top_users=TopUsers(users=10))
    ops = CacheOperations(daemon)
    with caplog.at_level(logging.INFO):
        daemon.top_users.observe(None, "bob", "a", "hello")
        ops.save_top_users()
        path.rmdir()
        daemon.top_users.observe(None, "bob", "a", "hello")
        ops.save_top_users()
        path.unlink()
        path.mkdir()
        daemon.top_users.observe(None, "bob", "a", "hello")
        ops.save_top_users()
    messages = [r.getMessage() for r in caplog.records if "top-users sketch" in r.getMessage()]
    assert len(messages) == 3 and messages[1] == "top-users sketch saved again", messages
