"""Faults a live fuzzing pass found on the control socket and in a reload's models.

Control arguments are checked: booleans must be booleans (``dry_run="no"`` once read as true),
counts whole numbers as documented (``warmup top_users=-1`` was accepted; it is >= 1), ``reload config=`` a table (a
string failed with a ValueError and an ERROR traceback in the log); each answered with one line
naming the argument, nothing logged. Through a real `ControlServer` and an in-process `Daemon`.

A model a reload adds that no worker can load leaves ``models.loading`` for ``models.failed``,
with its reason, logged once: unit tests of `Membership` with a fake pool, and end to end with a
callable whose target does not exist.
"""

from __future__ import annotations

import logging
import tomllib
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from dynbatchd import config as cfgmod
from dynbatchd.client import Client
from dynbatchd.config.reading import parse
from dynbatchd.control.server import ControlServer
from dynbatchd.membership import Membership
from dynbatchd.plugins import Plugins
from dynbatchd.service import Daemon

from conftest import SIMULATED, start_daemon, wait_until

CONFIG = """
[models.sim]
runner = "simulated"
[channels.standard]
max_batch = 8
window_ms = 1
[cache]
entries = 100
[daemon]
state_dir = "{state}"
"""


@pytest.fixture
def control(tmp_path):
    """handle(cmd, **args) -> the reply a real ControlServer gives an admin, for an in-process Daemon."""
    daemon = Daemon(parse(tomllib.loads(CONFIG.format(state=tmp_path))), Plugins.load())
    daemon._schedule_pump = lambda: None   # no event loop here: what a command queued is not run
    ctx = zmq.Context()
    server = ControlServer(ctx, f"inproc://control-faults-{id(tmp_path)}", daemon)
    try:
        yield lambda cmd, **args: server.handle(msgspec.msgpack.encode({"cmd": cmd, "args": args}))
    finally:
        server.io.sock.close(0)
        ctx.term()


BAD = [
    ("warmup", {"top_users": -1}, "top_users is a whole number >= 1, not -1"),
    ("warmup", {"top_users": 0}, "top_users is a whole number >= 1, not 0"),   # as documented: >= 1
    ("warmup", {"top_users": 2.5}, "top_users is a whole number >= 1, not 2.5"),
    ("warmup", {"top_users": True}, "top_users is a whole number >= 1, not True"),
    ("warmup", {"top_users": "10"}, "top_users is a whole number >= 1, not '10'"),
    ("reload", {"dry_run": "no"}, "dry_run is true or false, not 'no'"),
    ("reload", {"force": "x"}, "force is true or false, not 'x'"),
    ("reload", {"force": 1}, "force is true or false, not 1"),
    ("reload", {"dry_run": True, "config": "not toml ["}, "config is a configuration table"),
    ("reload", {"dry_run": True, "config": 5}, "config is a configuration table"),
    ("tune", {"channel": "standard", "max_batch": 4, "dry_run": "no"}, "dry_run is true or false, not 'no'"),
    ("tune", {"channel": "standard", "max_batch": 4, "force": "yes"}, "force is true or false, not 'yes'"),
    ("tune", {"channel": "standard", "rollback": "true"}, "rollback is true or false, not 'true'"),
    ("canary", {"action": "start", "channel": "standard", "max_batch": 4, "shadow": "no"},
     "shadow is true or false, not 'no'"),
    ("canary", {"action": "start", "channel": "standard", "max_batch": 4, "force": 0},
     "force is true or false, not 0"),
    ("tune", {"channel": "standard", "max_batch": 4, "why": 5}, "why is text of at most 500 characters, not 5"),
    ("tune", {"channel": "standard", "max_batch": 4, "why": "x" * 501}, "why is text of at most 500 characters"),
]


@pytest.mark.parametrize("cmd, args, error", BAD, ids=[f"{c}-{sorted(a)}" for c, a, _ in BAD])
def test_a_lax_argument_is_refused_naming_it_and_nothing_is_logged(control, caplog, cmd, args, error):
    with caplog.at_level(logging.WARNING):
        reply = control(cmd, **args)
    assert reply["ok"] is False and reply["error"].startswith(error), reply
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_a_long_argument_is_quoted_short(control):
    reply = control("reload", force="x" * 100_000)
    assert not reply["ok"] and len(reply["error"]) < 100


def test_good_arguments_still_pass(control):
    assert control("warmup", top_users=1)["ok"]
    assert control("warmup", top_users=10_000)["ok"]
    checked = control("reload", dry_run=True, config={"daemon": 5})   # a table: the config's own checks answer
    assert not checked["ok"] and "daemon" in checked["error"]


# -- a model a reload adds that no worker can load ---------------------------------------------------
def config(*models: str):
    return cfgmod.parse({"models": {m: {"runner": "noop"} for m in models},
                         "channels": {"c": {"max_batch": 1, "window_ms": 0, "deadline_ms": 10_000}},
                         "routing": {"default": "c"}}, "test")


class FakePool:
    """What `Membership` reads of a DevicePool: the model set asked, and each worker's answer."""

    def __init__(self, workers: int):
        self.models: list = []
        self.workers = [SimpleNamespace(index=i, state="ready", asked=(), models=(), unanswered=0, load_failures={})
                        for i in range(workers)]

    def set_models(self, specs):
        self.models = list(specs)
        for w in self.workers:
            w.asked = tuple(s.name for s in specs)

    def loaded(self, model):
        return any(model in w.models for w in self.workers)

    def ready(self, index: int, *models: str, failed: dict | None = None) -> None:
        self.workers[index].models, self.workers[index].load_failures = models, failed or {}


class FakeDaemon:
    def __init__(self, cfg, pool):
        from test_engine import engine   # (tests/engine)

        self.config, self.pool, self.devices = cfg, pool, ["cpu"]
        self.plugins = Plugins.load()
        self.engine = engine(inflight=1, max_batch=1)
        self.generation = SimpleNamespace(jobs={})   # causal-lm requests in flight (none here)
        self.membership = Membership(self, cfg)


def reloaded(pool, old, new) -> Membership:
    d = FakeDaemon(old, pool)
    d.config = new
    d.membership.change_models(old, new)
    return d.membership


def test_a_model_no_worker_loads_leaves_loading_for_failed_with_its_reason(caplog):
    pool = FakePool(2)
    m = reloaded(pool, config("a"), config("a", "broken"))
    assert m.loading_models == {"broken"} and pool.workers[0].asked == ("a", "broken")
    with caplog.at_level(logging.ERROR, logger="dynbatchd"):
        pool.ready(0, "a")
        m.models_loaded(0)
        assert m.loading_models == {"broken"} and not m.failed_models   # worker 1 has not answered yet
        pool.ready(1, "a")
        m.models_loaded(1)
        m.models_loaded(1)   # a second Ready: the failure is not logged again
    assert not m.loading_models and set(m.failed_models) == {"broken"}
    assert "no worker could load it" in m.failed_models["broken"]
    assert m.unready("broken").startswith("model 'broken' failed to load: no worker could load it")
    assert [r.getMessage() for r in caplog.records if "broken" in r.getMessage()] == [
        f"model broken failed to load after the reload: {m.failed_models['broken']}"]
    assert [s.name for s in pool.models] == ["a"]   # a worker that restarts is not asked for it


def test_a_ready_to_an_older_model_set_is_no_failure():
    pool = FakePool(1)
    m = reloaded(pool, config("a"), config("a", "b"))
    pool.workers[0].asked = ("a",)   # its Setup predates the reload: the pool sends the new set next
    m.models_loaded(0)
    assert m.loading_models == {"b"} and not m.failed_models


def test_a_ready_while_a_later_setup_is_unanswered_is_no_failure():
    # Two reloads in a row: the worker's Ready to the first arrives once the pool has sent it the
    # second set, so `asked` is already the current set; only the Setup count tells them apart.
    pool = FakePool(1)
    m = reloaded(pool, config("a"), config("a", "b"))
    pool.workers[0].unanswered = 1
    m.models_loaded(0)
    assert m.loading_models == {"b"} and not m.failed_models
    pool.workers[0].unanswered = 0
    pool.ready(0, "a", failed={"b": "ImportError: no module named b"})
    m.models_loaded(0)
    assert "ImportError: no module named b" in m.failed_models["b"]


def test_the_next_reload_that_changes_models_tries_a_failed_one_again():
    pool = FakePool(1)
    m = reloaded(pool, config("a"), config("a", "b"))
    m.models_loaded(0)
    assert set(m.failed_models) == {"b"}
    m.daemon.config = config("a", "b", "c")
    m.change_models(config("a", "b"), m.daemon.config)
    assert m.loading_models == {"b", "c"} and not m.failed_models
    assert [s.name for s in pool.models] == ["a", "b", "c"]
    pool.ready(0, "a", "b", "c")
    m.models_loaded(0)
    assert not m.loading_models and not m.failed_models and m.unready("b") is None


BROKEN = 'runner = "callable"\noptions = { target = "helpers:no_such_function" }\n'


def test_end_to_end_a_reload_adding_a_model_that_cannot_load_shows_it_failed(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED)
    try:
        # A good model added beside it still loads: each added model loads on its own.
        daemon.config.write_text(daemon.config.read_text() + "\n[models.broken]\n" + BROKEN
                                 + '\n[models.fine]\nrunner = "simulated"\n')
        result = daemon.call("reload", timeout_s=30)
        assert result["added"]["models"] == ["broken", "fine"]
        failed = wait_until(lambda: daemon.status()["models"]["failed"], 30, message="never shown failed")
        models = wait_until(lambda: (m := daemon.status()["models"]) and not m["loading"] and m, 30)
        assert "broken" in failed and "broken" not in models["loading"] + models["serving"]
        assert {"sim", "fine"} <= set(models["serving"])
        with Client(daemon.endpoint, timeout=10) as client:
            assert client.infer("fine", "loaded beside a broken one") is not None
        with pytest.raises(Exception) as refused:
            with Client(daemon.endpoint, timeout=10) as client:
                client.infer("broken", "x")
        assert "failed to load" in str(refused.value)
        with Client(daemon.endpoint, timeout=10) as client:
            assert client.infer("sim", "still served") is not None
        logs = daemon.logs()
        assert logs.count("model broken failed to load after the reload") == 1
        assert "has no attribute 'no_such_function'" in logs   # the worker's own line: the error
        assert "no_such_function" in failed["broken"]           # and status says it too
    finally:
        daemon.stop()


def test_a_reload_forgets_the_cached_answers_of_a_model_name_it_adds_or_unloads():
    """Found by fuzzing: m1 removed, then added again with other code, answered the old m1's cached
    results. Answers are keyed (model, tenant, text): a name reused must start empty."""
    from dynbatchd.cache import ResultCache
    from dynbatchd.engine.intake import cache_key_of

    pool = FakePool(1)
    daemon = FakeDaemon(config("a", "b"), pool)
    daemon.cache = ResultCache(100)
    for model in ("a", "b"):
        daemon.cache.put(cache_key_of(model, None, "same text"), f"{model}'s answer", "always")
    m = daemon.membership
    daemon.config = config("a")
    m.change_models(config("a", "b"), daemon.config)     # b removed: kept while its requests drain
    assert cache_key_of("b", None, "same text") in daemon.cache
    m.unload_drained_models()                             # nothing of b left: unloaded, its answers forgotten
    assert cache_key_of("b", None, "same text") not in daemon.cache
    daemon.cache.put(cache_key_of("b", None, "same text"), "a stale answer", "always")   # (say, put late)
    daemon.config = config("a", "b")
    m.change_models(config("a"), daemon.config)           # b added again: starts empty
    assert cache_key_of("b", None, "same text") not in daemon.cache
    assert daemon.cache.get(cache_key_of("a", None, "same text")) == "a's answer"
