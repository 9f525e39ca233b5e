"""The daemon's side of a reload that adds and removes models (`dynbatchd.membership`), with the
real engine, a fake clock and a fake device pool: an added model is loading until a worker has it;
a removed one stays on the workers until no request of it is queued or running; a pool that
cannot load models live (Ray) reports models as needing a restart, as does a change to a section
read only at start (the top-users sketch among them)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec

from dynbatchd import config as cfgmod
from dynbatchd.engine import Job
from dynbatchd.membership import Membership
from dynbatchd.operations import Operations
from dynbatchd.plugins import Plugins

from test_engine import MS, Clients, engine, ok_outcome


def config(*models: str, runner: str = "noop"):
    return cfgmod.parse({"models": {m: {"runner": runner} for m in models},
                         "channels": {"c": {"max_batch": 1, "window_ms": 0, "deadline_ms": 10_000}},
                         "routing": {"default": "c"}}, "test")


class FakePool:
    def __init__(self):
        self.asked: list[list[str]] = []
        self.has: set[str] = set()

    def set_models(self, specs):
        self.asked.append([s.name for s in specs])

    def loaded(self, model):
        return model in self.has


class Daemon:
    """What `Membership` reads of the daemon that holds it."""

    def __init__(self, cfg, pool):
        self.config, self.pool, self.devices = cfg, pool, ["cpu"]
        self.plugins = Plugins.load()
        self.engine = engine(inflight=1, max_batch=1)
        self.generation = SimpleNamespace(jobs={})   # causal-lm requests in flight: the engine does not hold them
        self.membership = Membership(self, cfg)   # as the daemon makes it at start


def test_an_added_model_loads_and_a_removed_one_waits_for_its_requests():
    pool, clients = FakePool(), Clients()
    old, new = config("a", "gone"), config("a", "b")
    d = Daemon(old, pool)
    d.engine.submit(Job("gone", "c", 1, 10_000, "g1"), 0)   # accepted before the reload
    d.config, m = new, d.membership
    m.change_models(old, new)
    assert m.loading_models == {"b"} and m.unloading_models == {"gone"}
    assert pool.asked == [["a", "b", "gone"]]   # the removed model stays loaded meanwhile
    pool.has = {"a", "b", "gone"}
    m.models_loaded()
    assert not m.loading_models
    m.unload_drained_models()
    assert m.unloading_models == {"gone"}       # g1 still queued
    dispatches, _ = d.engine.step(0)
    m.unload_drained_models()
    assert m.unloading_models == {"gone"}       # g1 running
    clients.take(d.engine.completed(0, dispatches[0].batch.id, ok_outcome(dispatches[0].batch), MS))
    m.unload_drained_models()
    assert not m.unloading_models and pool.asked[-1] == ["a", "b"]
    assert clients.codes() == {"g1": "ok"}


def test_a_removed_model_waits_for_its_generations_too():
    """A causal-lm model's requests are its workers' step loops', not the engine's: a reload that
    removed one said it was unloaded while a stream of it still ran."""
    pool = FakePool()
    old, new = config("a", "gone"), config("a")
    d = Daemon(old, pool)
    d.generation.jobs[1] = SimpleNamespace(pending=SimpleNamespace(request=SimpleNamespace(model="gone")))
    d.config, m = new, d.membership
    m.change_models(old, new)
    m.unload_drained_models()
    assert m.unloading_models == {"gone"}       # its stream still runs
    del d.generation.jobs[1]
    m.unload_drained_models()
    assert not m.unloading_models and pool.asked[-1] == ["a"]


def test_models_need_a_restart_only_on_a_pool_that_cannot_load_them_or_when_settings_change():
    live = Daemon(config("a"), FakePool()).membership
    assert not live.models_need_restart(config("a"), config("a", "b"))
    assert live.models_need_restart(config("a"), config("a", runner="simulated"))
    ray = Daemon(config("a"), object()).membership   # no set_models
    assert ray.models_need_restart(config("a"), config("a", "b"))
    assert Membership.added_removed(config("a", "gone"), config("a", "b")) == (
        {"channels": [], "models": ["b"]}, {"channels": [], "models": ["gone"]})


def test_a_change_to_what_is_built_at_start_needs_a_restart_not_a_silent_reload():
    """The top-users sketch and the HTTP door are built at start; a reload that changed [top_users]
    or [http] once reported nothing to restart and went on with the old ones."""
    before = config("a")
    operations = Operations(Daemon(before, FakePool()))
    sketch = msgspec.structs.replace(before, top_users=msgspec.structs.replace(before.top_users, max_text_bytes=100))
    door = msgspec.structs.replace(before, http={"listen": "127.0.0.1:8080"})
    assert operations.needs_restart(sketch) == ["top_users"]
    assert operations.needs_restart(door) == ["http"]
    assert operations.needs_restart(before) == []
