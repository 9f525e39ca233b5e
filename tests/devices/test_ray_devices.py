"""Devices on Ray actors: the same batch protocol and supervision contract as local workers.

One local Ray cluster per module (CPU actors, loopback, a small object store):
the pool is driven directly against it, and a daemon in a subprocess joins it
as a second driver. An actor killed mid-batch (`ray.kill`) must cost no
request its one reply, and the device must come back on a new actor.
"""

from __future__ import annotations

import asyncio
import os
import textwrap
import tomllib

import subprocess
import sys

import pytest
from conftest import REPO, SIMULATED, TESTS, start_daemon, wait_until

from dynbatchd import config as cfgmod, protocol as P
from dynbatchd.client import Client
from dynbatchd.config import ConfigError, RaySettings, parse
from dynbatchd.daemon_batches import decode_outcome
from dynbatchd.devices.ray_pool import RayDevicePool, import_ray

ray = None   # the module, once the `cluster` fixture has imported it

MODELS = [P.ModelSpec("fast", "simulated", {"base_ms": 1.0}), P.ModelSpec("slow", "simulated", {"base_ms": 60_000.0})]


@pytest.fixture(scope="module")
def cluster():
    global ray
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'dynbatchd[ray]'): "
                                            "Ray devices untested")
    # Actors import tests/helpers.py (the callable runner) like local workers do.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024 * 1024,
             namespace="dynbatchd", log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def batch(batch_id: int, model: str, texts: list[str]) -> list[bytes]:
    items = [P.BatchItem(text=t, tokens=len(t)) for t in texts]
    return [P.encoder.encode(P.BatchMsg(batch_id, model, items))]


class Recorder:
    """The daemon's side of the pool: what it heard, and a way to wait for it on the loop."""

    def __init__(self):
        self.results: dict[int, tuple[P.BatchResult, list[bytes]]] = {}
        self.lost: list[int] = []
        self.ready: list[int] = []
        self.gone: list[int] = []

    def pool(self, restart_limit: int = 5) -> RayDevicePool:
        settings = RaySettings(cpus=1, cpus_per_actor=0.5)
        return RayDevicePool(None, settings.device_names(), MODELS, cpu_threads=1, ipc_dir="", ray=settings,
                             restart_limit=restart_limit, on_result=lambda i, r, f: self.results.__setitem__(
                                 r.batch_id, (r, f)),
                             on_lost=lambda i: self.lost.append(i) or False, on_ready=self.ready.append,
                             on_gone=self.gone.append)


async def until(predicate, timeout_s: float = 60.0) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(poll(), timeout_s)


def load_config_text(text: str):
    return parse(tomllib.loads(text))


def test_config_needs_exactly_one_kind_of_ray_device():
    base = textwrap.dedent(SIMULATED) + "\n[devices]\n"
    with pytest.raises(ConfigError, match="devices.ray"):
        load_config_text(base + "ray = { address = 'auto' }\n")
    with pytest.raises(ConfigError, match="devices.ray"):
        load_config_text(base + "ray = { gpus = 2, cpus = 2 }\n")
    with pytest.raises(ConfigError, match="devices.ray.gpus"):
        load_config_text(base + "ray = { gpus = -1 }\n")
    assert load_config_text(base + "ray = { gpus = 4 }\n").devices.ray.gpus == 4


def test_without_ray_a_config_asking_for_it_is_refused_saying_what_to_install(monkeypatch):
    real = cfgmod.rules.importlib.util.find_spec
    monkeypatch.setattr(cfgmod.rules.importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError, match=r"devices\.ray.*pip install 'dynbatchd\[ray\]'"):
        load_config_text(textwrap.dedent(SIMULATED) + "\n[devices]\nray = { cpus = 1 }\n")
    monkeypatch.setitem(sys.modules, "ray", None)   # `import ray` now raises ImportError
    with pytest.raises(RuntimeError, match=r"pip install 'dynbatchd\[ray\]'"):
        import_ray()


def test_the_default_install_path_never_imports_ray():
    code = ("import sys, dynbatchd.service, dynbatchd.cli.dynbatchctl, dynbatchd.devices.ray_pool; "
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.stdout.strip() == "False", out.stderr


def test_an_actor_runs_a_batch_and_says_where_it_lives(cluster):
    rec = Recorder()

    async def scenario():
        pool = rec.pool()
        await pool.start(timeout_s=120)
        try:
            assert rec.ready == [0]
            assert pool.send(0, batch(1, "fast", ["ab", "abcd"]))
            await until(lambda: 1 in rec.results)
            return pool.describe(0)
        finally:
            await pool.stop()

    where = asyncio.run(scenario())
    result, frames = rec.results[1]
    outcome = decode_outcome(result, frames, 2)
    assert outcome.problem is None and outcome.simulated
    lengths = [float(memoryview(buf).cast("B").cast("f")[0]) for _, buf in outcome.outputs]
    assert lengths == [2.0, 4.0]            # each input's own answer: [length, tokens]
    assert where["state"] == "ready" and where["node"] and where["actor"] and where["pid"] > 0
    assert rec.lost == [] and rec.gone == []


def test_an_actor_killed_mid_batch_is_reported_lost_once_and_replaced(cluster):
    rec = Recorder()

    async def scenario():
        pool = rec.pool()
        await pool.start(timeout_s=120)
        try:
            first = pool.describe(0)["actor"]
            assert pool.send(0, batch(1, "slow", ["a"]))       # runs for a minute: in flight when killed
            assert pool.send(0, batch(2, "slow", ["b"]))       # queued behind it on the same actor
            ray.kill(ray.get_actor(pool.describe(0)["actor_name"]))
            await until(lambda: rec.ready == [0, 0])            # a new actor came up
            assert pool.send(0, batch(3, "fast", ["c"]))
            await until(lambda: 3 in rec.results)
            return first, pool.describe(0)
        finally:
            await pool.stop()

    first, after = asyncio.run(scenario())
    assert rec.lost == [0]                  # both calls failed; the engine hears of one death
    assert 1 not in rec.results and 2 not in rec.results
    assert after["actor"] != first and after["restarts"] == 1 and after["state"] == "ready"
    assert rec.gone == []


def test_an_actor_that_dies_idle_is_noticed_and_replaced(cluster):
    rec = Recorder()

    async def scenario():
        pool = rec.pool()
        await pool.start(timeout_s=120)
        try:
            first = pool.describe(0)["actor"]
            ray.kill(ray.get_actor(pool.describe(0)["actor_name"]))   # no batch in flight
            await until(lambda: rec.ready == [0, 0])
            return first, pool.describe(0)
        finally:
            await pool.stop()

    first, after = asyncio.run(scenario())
    assert rec.lost == [0] and after["actor"] != first and after["state"] == "ready"


def test_daemon_on_ray_answers_every_request_once_when_its_actor_is_killed(cluster, tmp_path):
    body = SIMULATED.replace("base_ms = 2.0", "base_ms = 300.0")
    daemon = start_daemon(tmp_path, body, devices_extra=f'ray = {{ address = "{cluster}", cpus = 1, '
                                                       f'cpus_per_actor = 0.5 }}')
    try:
        devices = daemon.status()["devices"]
        assert [d["device"] for d in devices] == ["ray:cpu0"]
        assert devices[0]["node"] and devices[0]["actor"]
        first = devices[0]["actor"]
        with Client(daemon.endpoint) as client:
            futures = [client.submit("sim", f"r{i}", deadline_ms=60_000) for i in range(20)]
            wait_until(lambda: daemon.status()["devices"][0]["inflight"] > 0, 30, message="no batch in flight")
            ray.kill(ray.get_actor(daemon.status()["devices"][0]["actor_name"]))
            replies = [f.result(timeout=120) for f in futures]
        assert all(r.output is not None for r in replies)
        after = wait_until(lambda: (d := daemon.status()["devices"][0])["state"] == "ready" and d, 60,
                           message="the device did not come back")
        assert after["actor"] != first and after["restarts"] == 1
    finally:
        daemon.stop()


def test_status_table_says_where_each_device_lives():
    from dynbatchd.cli.dynbatchctl import DEVICE_COLUMNS

    where = next(cell for header, _, cell in DEVICE_COLUMNS if header == "where")
    ray_device = {"device": "ray:gpu0", "node": "10.0.0.7", "actor": "28bfff7654726583de02ca8501000000"}
    assert where(ray_device) == "10.0.0.7 actor 28bfff765472"
    assert where({"device": "cuda:0", "pid": 42}) == "local"
