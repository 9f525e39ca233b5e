"""Per-device batch limits in a mixed pool: the config's memory_gb by device, the limits the daemon
computes, an out-of-memory learned by the device that had it, and status showing each device's limit."""

from __future__ import annotations

import pytest
from rich.console import Console

from dynbatchd import config as cfgmod
from dynbatchd.cli.dynbatchctl import _limit_text, status_view
from dynbatchd.config import ChannelSettings
from dynbatchd.devices.runners import OptionError, SimulatedRunner, check_options
from dynbatchd.engine import Engine, Job, Outcome
from dynbatchd.memory import DeviceLimit, device_limits
from dynbatchd.plugins import Plugins
from dynbatchd.scheduler import build_channels
from dynbatchd.telemetry import NvmlProbe

MS = 1_000_000
RUNNERS = Plugins.load().runners()   # the runner classes, which say what the planner sizes them from
BASE = {"models": {"m": {"runner": "sentence-embedding"}},
        "channels": {"standard": {"max_batch": 64, "window_ms": 1}}}


def parse(devices: dict) -> cfgmod.Config:
    return cfgmod.parse({**BASE, "devices": devices})


# --- config ---------------------------------------------------------------------------------
def test_memory_gb_is_one_number_for_every_device_or_a_table_by_device():
    every = parse({"memory_gb": 40})
    assert every.devices.memory_gb_of("cuda:0") == every.devices.memory_gb_of("cpu") == 40.0
    table = parse({"use": ["cuda:0", "cuda:1"], "memory_gb": {"cuda:0": 80, "cuda:1": 24}})
    assert (table.devices.memory_gb_of("cuda:0"), table.devices.memory_gb_of("cuda:1")) == (80.0, 24.0)
    assert table.devices.memory_gb_of("cuda:2") == 0.0   # not configured: NVML is asked


@pytest.mark.parametrize("devices, key, rule", [
    ({"use": ["cuda:0"], "memory_gb": {"cuda:0": 80, "cuda:1": 24}}, "devices.memory_gb.cuda:1",
     "not one of the devices in devices.use (cuda:0)"),
    ({"memory_gb": {"cuda:0": -1}}, "devices.memory_gb.cuda:0", ">= 0.0, got `-1`"),
    ({"memory_gb": -2}, "devices.memory_gb", ">= 0.0, got `-2`"),
    ({"memory_gb": {"gpu0": 8}}, "devices.memory_gb.gpu0", "is not a device (cpu, cuda:N)"),
    ({"memory_gb": {"cuda:0": "big"}}, "devices.memory_gb.cuda:0", "expected `float`"),
])
def test_a_bad_memory_gb_is_refused_naming_the_key_and_the_rule(devices, key, rule):
    with pytest.raises(cfgmod.ConfigError) as err:
        parse(devices)
    assert f": {key}: " in str(err.value) and rule in str(err.value)


def test_ray_devices_are_named_in_the_memory_table_as_status_names_them():
    pytest.importorskip("ray", reason="the [ray] extra is not installed")
    cfg = parse({"ray": {"gpus": 2}, "memory_gb": {"ray:gpu0": 80, "ray:gpu1": 24}})
    assert [cfg.devices.memory_gb_of(d) for d in cfg.devices.ray.device_names()] == [80.0, 24.0]
    with pytest.raises(cfgmod.ConfigError) as err:
        parse({"ray": {"gpus": 2}, "memory_gb": {"cuda:0": 80}})
    assert ": devices.memory_gb.cuda:0: " in str(err.value)
    assert "not one of the Ray devices (ray:gpu0, ray:gpu1)" in str(err.value)


def test_a_reload_checks_memory_gb_as_a_start_does(tmp_path):
    path = tmp_path / "d.toml"
    path.write_text('[models.m]\nrunner = "noop"\n[channels.standard]\nmax_batch = 4\nwindow_ms = 1\n'
                    '[devices]\nuse = ["cuda:0"]\nmemory_gb = { "cuda:1" = 24 }\n')
    with pytest.raises(cfgmod.ConfigError, match="devices.memory_gb.cuda:1"):
        cfgmod.load(path)   # what `reload` calls before anything is applied


def test_the_simulated_runner_takes_options_for_one_device_and_checks_them():
    check_options(SimulatedRunner, {"memory_items": 16, "devices": {"cuda:1": {"memory_items": 4}}})
    assert SimulatedRunner("cuda:1", {"memory_items": 16, "devices": {"cuda:1": {"memory_items": 4}}}).model.memory_items == 4
    assert SimulatedRunner("cuda:0", {"memory_items": 16, "devices": {"cuda:1": {"memory_items": 4}}}).model.memory_items == 16
    with pytest.raises(OptionError, match="cuda:1.memory_itms: unknown option"):
        check_options(SimulatedRunner, {"devices": {"cuda:1": {"memory_itms": 4}}})
    with pytest.raises(OptionError, match="cuda:1.memory_items: expected an integer >= 0"):
        check_options(SimulatedRunner, {"devices": {"cuda:1": {"memory_items": -1}}})


# --- the limits the daemon gives its engine ------------------------------------------------------
class FakeNvml:
    """Enough of pynvml for NvmlProbe: GPU 0 has 80 GiB."""
    def nvmlDeviceGetHandleByIndex(self, index):
        if index != 0:
            raise RuntimeError("no such GPU")
        return index

    def nvmlDeviceGetUtilizationRates(self, handle):
        raise RuntimeError("not supported")

    def nvmlDeviceGetMemoryInfo(self, handle):
        return type("Mem", (), {"used": 0, "total": 80 << 30})()

    def nvmlDeviceGetPowerUsage(self, handle):
        raise RuntimeError("not supported")


def test_each_device_is_sized_from_its_configured_memory_else_nvml_else_unlimited(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = parse({"use": ["cuda:0", "cuda:1", "cpu"], "memory_gb": {"cuda:1": 2}})
    nvml, small, cpu = device_limits(cfg, ["cuda:0", "cuda:1", "cpu"], RUNNERS, NvmlProbe(FakeNvml()))
    assert (nvml.source, small.source, cpu) == ("NVML", "config", DeviceLimit(0, 0, ""))
    assert nvml.items > small.items > 0      # 80 GiB holds far more of the model than 2 GB
    # The configured figure wins over NVML's for the same device.
    cfg = parse({"use": ["cuda:0"], "memory_gb": {"cuda:0": 2}})
    assert device_limits(cfg, ["cuda:0"], RUNNERS, NvmlProbe(FakeNvml())) == [small]


def test_a_simulated_device_is_sized_by_its_own_memory_items():
    cfg = cfgmod.parse({"models": {"sim": {"runner": "simulated", "options": {
                            "memory_items": 32, "memory_tokens": 900, "devices": {"cuda:1": {"memory_items": 4}}}}},
                        "channels": BASE["channels"], "devices": {"use": ["cuda:0", "cuda:1"]}})
    assert device_limits(cfg, ["cuda:0", "cuda:1"], RUNNERS) == [(32, 900, "runner"), (4, 900, "runner")]


# --- an out-of-memory, learned where it happened -------------------------------------------------
def engine(limits) -> Engine:
    e = Engine(build_channels({"c": ChannelSettings(max_batch=8, window_ms=0, deadline_ms=10_000)}),
               ["big", "small"], inflight=1, device_limits=limits)
    e.device_up(0)
    e.device_up(1)
    return e


def oom_on_small(e: Engine, now: int) -> tuple[int, int]:
    """Fill both devices, answer the small one's batch out-of-memory; (big's size, small's size)."""
    for i in range(16):
        e.submit(Job("m", "c", 1, 10_000, i), now)
    dispatches, _ = e.step(now)
    sizes = {d.device: len(d.batch.items) for d in dispatches}
    for d in dispatches:
        oom = d.device == 1
        e.completed(d.device, d.batch.id, Outcome(MS, [None] * len(d.batch.items), oom=oom), now + MS)
    return sizes[0], sizes[1]


def test_in_a_mixed_pool_an_oom_lowers_only_that_devices_limit_and_status_says_so():
    e = engine([(8, 0, "config"), (6, 0, "config")])
    assert oom_on_small(e, 0) == (8, 6)
    assert e.device_limits == [(8, 0), (3, 0)]                   # halved, as the worker's bisection did
    assert e.channels["c"].sizer.max_batch() == 8                 # the big device's batches stay whole
    limits = [d["batch_limit"] for d in e.snapshot(2 * MS)["devices"]]
    assert limits == [{"items": 8, "tokens": 0, "source": "config"},
                      {"items": 3, "tokens": 0, "source": "learned after OOM"}]
    assert oom_on_small(e, 10 * MS) == (8, 3)                     # the next batches are sized to it


def test_in_a_uniform_pool_an_oom_shrinks_the_channels_batches_as_before():
    e = engine([(8, 0, "config"), (8, 0, "config")])
    oom_on_small(e, 0)
    assert e.device_limits == [(8, 0), (8, 0)]
    assert e.channels["c"].sizer.max_batch() == 4
    assert [d["batch_limit"]["source"] for d in e.snapshot(2 * MS)["devices"]] == ["config", "config"]


def test_an_unknown_limit_on_the_device_that_ran_out_becomes_a_learned_one():
    e = engine([(8, 0, "config"), (0, 0, "")])
    oom_on_small(e, 0)
    assert e.device_limits[1] == (4, 0) and e.limit_sources[1] == "learned after OOM"


def test_status_shows_a_limit_its_source_or_none():
    assert _limit_text({"items": 4, "tokens": 0, "source": "runner"}) == "4 items (runner)"
    assert _limit_text({"items": 3, "tokens": 2048, "source": "learned after OOM"}) == \
        "3 items, 2048 tokens (learned after OOM)"
    assert _limit_text({"items": 0, "tokens": 0, "source": ""}) == _limit_text(None) == "-"


# --- end to end: a live daemon with two simulated devices of different memory ---------------------
MIXED = """
    [models.sim]
    runner = "simulated"
    options = { base_ms = 10.0, per_item_ms = 0.2, memory_items = 16, devices = { "cuda:1" = { memory_items = 3 } } }
    [channels.standard]
    max_batch = 16
    window_ms = 5
    deadline_ms = 60000
    queue_limit = 4096
    [routing]
    default = "standard"
"""


def test_a_live_mixed_pool_sizes_each_devices_batches_to_its_memory(tmp_path):
    from conftest import start_daemon

    from dynbatchd.client import Client

    daemon = start_daemon(tmp_path, MIXED, devices=("cuda:0", "cuda:1"), cpu_threads=1,
                          devices_extra='inflight = 1\nmemory_gb = { "cuda:0" = 80, "cuda:1" = 24 }')
    try:
        limits = {d["device"]: d["batch_limit"] for d in daemon.status()["devices"]}
        assert limits == {"cuda:0": {"items": 16, "tokens": 0, "source": "runner"},
                          "cuda:1": {"items": 3, "tokens": 0, "source": "runner"}}
        with Client(daemon.endpoint) as client:
            futures = [client.submit("sim", f"r{i}") for i in range(120)]
            timings = [f.result(timeout=120).timing for f in futures]
        sizes = {"cuda:0": [], "cuda:1": []}
        for t in timings:
            sizes[t.device].append(t.batch_size)
        assert sizes["cuda:1"] and max(sizes["cuda:1"]) <= 3, sizes   # the small device took work, sized to it
        assert max(sizes["cuda:0"]) > 3                                 # the big one ran bigger batches
        status = daemon.status()
        assert [d["batch_limit"]["source"] for d in status["devices"]] == ["runner", "runner"]   # no OOM to learn
        console = Console(width=200, record=True)
        console.print(status_view(status, console))
        shown = console.export_text()
        assert "16 items (runner)" in shown and "3 items (runner)" in shown
    finally:
        daemon.stop()
