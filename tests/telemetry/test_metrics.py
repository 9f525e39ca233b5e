"""The /metrics page, without a daemon: names and types, the NVML figures, the families that
appear only where their data exists, exact numbers; NvmlProbe on a stand-in NVML; the device
observer's readings. tests/telemetry/test_metrics_live.py checks a live daemon's page (promtool, a real
Prometheus, the Grafana dashboard)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import types

import pytest

from dynbatchd import metrics
from dynbatchd import observer
from dynbatchd.engine import Engine
from dynbatchd.telemetry import Histogram, NvmlProbe, SchedulingPasses

PROMTOOL = shutil.which("promtool")


def channel_status(**extra) -> dict:
    base = {"queue_depth": 3, "max_batch": 16, "accepted": 10, "completed": 8, "batches": 4, "mean_batch": 2.0,
            "fill_rate": 0.125, "p50_ms": 4.0, "p99_ms": 9.0, "p999_ms": 9.5,
            "rejected": {"overloaded": 1, "refused": 2}, "expired": 1, "late": 0, "failed": 0, "on_time": 0.9,
            "on_time_count": 9, "offered": 10, "scheduling_efficiency": 0.5, "cache_hits": 1,
            "warmup": {"batches": 1, "items": 5}, "window": {"policy": "fixed", "window_ms": 5.0}}
    return {**base, **extra}


def status(channels=None, devices=None, cache=None, **daemon) -> dict:
    return {
        "daemon": {"version": "9.9.9", "state": "serving", "uptime_s": 12.5, "bad_requests": 0, "dropped": 0,
                   "replies_undelivered": 0, "quarantined": 0, "health": {"score": 0.8}, **daemon},
        "channels": channels if channels is not None else {"standard": channel_status()},
        "devices": devices if devices is not None else [
            {"device": "cpu", "inflight": 0, "batches": 4, "items": 8, "busy_fraction": 0.25, "name": "w0-cpu",
             "index": 0, "pid": 1, "state": "ready", "restarts": 2, "simulated": False}],
        "cache": cache,
    }


def samples(page: str) -> dict[str, float]:
    """`name{labels}` -> value, for every sample line."""
    out = {}
    for line in page.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def types_of(page: str) -> dict[str, str]:
    return {line.split()[2]: line.split()[3] for line in page.splitlines() if line.startswith("# TYPE ")}


def latency() -> dict[str, Histogram]:
    h = Histogram()
    for us in (900, 4000, 12_000):
        h.record(us)
    return {"standard": h}


def test_names_follow_the_conventions():
    page = metrics.render(status(cache={"entries": 1, "capacity": 8, "hits": 3, "misses": 4, "hit_rate": 0.4,
                                        "warmup_backlog": 0}), latency(), gpu={})
    kinds = types_of(page)
    for name, kind in kinds.items():
        assert name.startswith("dynbatchd_"), name
        assert (kind == "counter") == name.endswith("_total"), f"{name} is a {kind}"
    assert kinds["dynbatchd_device_restarts_total"] == "counter"
    assert kinds["dynbatchd_request_duration_seconds"] == "histogram"
    assert kinds["dynbatchd_latency_seconds"] == "summary"   # quantile labels belong to a summary
    got = samples(page)
    assert got['dynbatchd_build_info{version="9.9.9",python="' + __import__("platform").python_version() + '"}'] == 1
    assert got["dynbatchd_up"] == 1 and got['dynbatchd_state{state="serving"}'] == 1
    assert got['dynbatchd_state{state="draining"}'] == 0
    assert got['dynbatchd_device_restarts_total{device="cpu",simulated="false"}'] == 2
    assert got['dynbatchd_device_busy_ratio{device="cpu",simulated="false"}'] == 0.25
    assert got['dynbatchd_requests_cached_total{channel="standard"}'] == 1
    assert got['dynbatchd_requests_rejected_total{channel="standard",reason="refused"}'] == 2
    assert got['dynbatchd_batched_requests_total{channel="standard"}'] == 8
    assert got['dynbatchd_batch_fill_total{channel="standard"}'] == 0.5
    assert got['dynbatchd_warmup_requests_total{channel="standard"}'] == 5
    assert got['dynbatchd_batch_window_seconds{channel="standard"}'] == 0.005
    assert got['dynbatchd_latency_seconds{channel="standard",quantile="0.99"}'] == 0.009
    assert got['dynbatchd_latency_seconds_count{channel="standard"}'] == 3
    assert got["dynbatchd_cache_hits_total"] == 3 and got["dynbatchd_cache_misses_total"] == 4
    assert got["dynbatchd_cache_capacity_entries"] == 8 and got["dynbatchd_warmup_backlog_requests"] == 0
    assert "dynbatchd_cache_evictions_total" not in kinds   # the cache does not count them (yet)


@pytest.mark.parametrize("state, up", [("serving", 1), ("draining", 0), ("unavailable", 0), ("starting", 0)])
def test_up_follows_the_daemon_state(state, up):
    got = samples(metrics.render(status(state=state), gpu={}))
    assert got["dynbatchd_up"] == up
    assert got[f'dynbatchd_state{{state="{state}"}}'] == 1
    assert sum(v for k, v in got.items() if k.startswith("dynbatchd_state{")) == 1


def test_counters_keep_every_digit():
    page = metrics.render(status(channels={"standard": channel_status(completed=123_456_789)}), gpu={})
    assert 'dynbatchd_requests_completed_total{channel="standard"} 123456789\n' in page


def test_label_values_are_escaped():
    page = metrics.render(status(channels={'we"ird\\name': channel_status()}), gpu={})
    assert 'dynbatchd_queue_depth{channel="we\\"ird\\\\name"} 3' in page


def test_nvml_figures_only_where_nvml_answers():
    devices = [{"device": f"cuda:{i}", "inflight": 1, "batches": 0, "items": 0, "busy_fraction": 0.5,
                "state": "ready", "restarts": 0, "simulated": False} for i in range(2)]
    on_cpu = metrics.render(status(), gpu={})
    for name in metrics.NVML_METRICS:
        assert name not in on_cpu   # no family at all, not even HELP
    readings = {"cuda:0": NvmlProbe.Reading(0.75, 3 << 30, 80 << 30, 312.5),
                "cuda:1": NvmlProbe.Reading(0.5, 1 << 30, 80 << 30, None)}   # no power reading
    got = samples(metrics.render(status(devices=devices), gpu=readings))
    assert got['dynbatchd_gpu_utilisation_ratio{device="cuda:0"}'] == 0.75
    assert got['dynbatchd_gpu_memory_used_bytes{device="cuda:0"}'] == 3 << 30
    assert got['dynbatchd_gpu_memory_total_bytes{device="cuda:1"}'] == 80 << 30
    assert got['dynbatchd_gpu_power_watts{device="cuda:0"}'] == 312.5
    assert 'dynbatchd_gpu_power_watts{device="cuda:1"}' not in got
    # the busy ratio stays beside NVML's figure
    assert got['dynbatchd_device_busy_ratio{device="cuda:0",simulated="false"}'] == 0.5


def test_status_gpu_field_is_used_where_status_has_it():
    devices = [{"device": "cuda:0", "busy_fraction": 0.1, "gpu": {"utilisation": 0.3, "memory_used_bytes": 5,
                                                                   "memory_total_bytes": 10, "power_watts": 70.0}}]
    got = samples(metrics.render(status(devices=devices), gpu={}))
    assert got['dynbatchd_gpu_utilisation_ratio{device="cuda:0"}'] == 0.3
    assert got['dynbatchd_gpu_power_watts{device="cuda:0"}'] == 70.0


def test_render_reads_the_observer_by_default(monkeypatch):
    monkeypatch.setitem(observer._latest, "cuda:0", NvmlProbe.Reading(0.2, 1, 2, None))
    devices = [{"device": "cuda:0", "busy_fraction": 0.1}]
    got = samples(metrics.render(status(devices=devices)))
    assert got['dynbatchd_gpu_utilisation_ratio{device="cuda:0"}'] == 0.2


def test_families_that_wait_for_their_status_fields():
    """The batch-size histogram, the compute/wait counters and cache evictions appear once
    status carries `batch_sizes`, `compute_s`/`wait_s` and `evictions` (docs/metrics.md)."""
    plain = types_of(metrics.render(status(), gpu={}))
    for name in ("dynbatchd_batch_size", "dynbatchd_batch_compute_seconds_total",
                 "dynbatchd_queue_wait_seconds_total"):
        assert name not in plain
    channel = channel_status(batch_sizes={1: 2, 3: 1, "16": 1}, compute_s=1.5, wait_s=0.5, fill_sum=0.7)
    page = metrics.render(status(channels={"standard": channel},
                                 cache={"hits": 0, "misses": 0, "evictions": 4}), gpu={})
    assert types_of(page)["dynbatchd_batch_size"] == "histogram"
    got = samples(page)
    bucket = 'dynbatchd_batch_size_bucket{{channel="standard",le="{}"}}'
    assert [got[bucket.format(le)] for le in (1, 2, 3, 12, 16, "+Inf")] == [2, 2, 3, 3, 4, 4]
    assert got['dynbatchd_batch_size_sum{channel="standard"}'] == 1 * 2 + 3 + 16
    assert got['dynbatchd_batch_size_count{channel="standard"}'] == 4
    assert got['dynbatchd_batch_compute_seconds_total{channel="standard"}'] == 1.5
    assert got['dynbatchd_queue_wait_seconds_total{channel="standard"}'] == 0.5
    assert got['dynbatchd_batch_fill_total{channel="standard"}'] == 0.7   # the exact sum, where status has it
    assert got["dynbatchd_cache_evictions_total"] == 4


def test_buckets_increase_and_end_at_the_largest_batch():
    assert list(metrics.BATCH_SIZE_BUCKETS) == sorted(set(metrics.BATCH_SIZE_BUCKETS))
    from dynbatchd.config import MAX_BATCH
    assert metrics.BATCH_SIZE_BUCKETS[-1] == MAX_BATCH


def test_a_page_before_the_workers_are_up():
    """While starting, status has no pool figures (state, restarts, simulated): the page still renders."""
    devices = [{"device": "cpu", "inflight": 0, "batches": 0, "items": 0, "busy_fraction": 0.0}]
    got = samples(metrics.render(status(devices=devices, state="starting"), gpu={}))
    assert got["dynbatchd_up"] == 0
    assert got['dynbatchd_device_busy_ratio{device="cpu",simulated="false"}'] == 0


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package `prometheus`; .ci/run installs it)")
def test_promtool_accepts_a_page_with_every_family():
    devices = [{"device": "cuda:0", "inflight": 1, "batches": 3, "items": 9, "busy_fraction": 0.5,
                "state": "restarting", "restarts": 1, "simulated": False}]
    channel = channel_status(batch_sizes={1: 2, 5: 1}, compute_s=1.5, wait_s=0.5,
                             window={"policy": "pattern", "window_ms": "tiered", "traffic": "burst"})
    page = metrics.render(status(channels={"standard": channel}, devices=devices,
                                 cache={"entries": 1, "capacity": 8, "hits": 3, "misses": 4, "evictions": 1,
                                        "warmup_backlog": 2}),
                          latency(), gpu={"cuda:0": NvmlProbe.Reading(0.75, 3 << 30, 80 << 30, 312.5)})
    check = subprocess.run([PROMTOOL, "check", "metrics"], input=page, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


# -- the HTTP endpoint -------------------------------------------------------

def test_a_page_that_fails_to_render_answers_500():
    async def scrape():
        def broken() -> str:
            raise KeyError("no such field")

        server = await metrics.serve("127.0.0.1:0", broken)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await reader.read()
        writer.close()
        server.close()
        return answer

    assert asyncio.run(scrape()).startswith(b"HTTP/1.1 500 ")


# -- NvmlProbe on a stand-in NVML -------------------------------------------

class FakeNvml:
    """What NvmlProbe uses of pynvml, for two GPUs; GPU 1 reports no power."""

    class NotSupported(Exception):
        pass

    def __init__(self):
        self.by_index = {0: "h0", 1: "h1"}
        self.by_uuid = {"GPU-aaaa": "h1"}

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.by_index[index]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return self.by_uuid[uuid]

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu={"h0": 40, "h1": 90}[handle])

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used={"h0": 2 << 30, "h1": 6 << 30}[handle], total=8 << 30)

    def nvmlDeviceGetPowerUsage(self, handle):
        if handle == "h1":
            raise self.NotSupported()
        return 250_500   # milliwatts

    def nvmlDeviceGetName(self, handle):
        return {"h0": b"NVIDIA H200", "h1": "NVIDIA L4"}[handle]


def test_nvml_probe_reads_every_figure(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    probe = NvmlProbe(FakeNvml())
    assert probe.sample("cuda:0") == NvmlProbe.Reading(0.4, 2 << 30, 8 << 30, 250.5)
    assert probe.sample("cuda:0").memory_fraction == 0.25
    assert probe.sample("cuda:1") == NvmlProbe.Reading(0.9, 6 << 30, 8 << 30, None)   # power not supported
    assert probe.read("cuda:0") == (0.4, 0.25)   # what the batch sizers get, as before
    assert probe.sample("cpu") is None and probe.sample("cuda:7") is None


def test_nvml_probe_names_each_gpu_and_capacity_reports_its_power(monkeypatch):
    from dynbatchd import capacity, telemetry

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    probe = NvmlProbe(FakeNvml())
    assert (probe.name("cuda:0"), probe.name("cuda:1"), probe.name("cpu")) == ("NVIDIA H200", "NVIDIA L4", None)
    monkeypatch.setattr(telemetry, "NvmlProbe", lambda: NvmlProbe(FakeNvml()))
    assert capacity.nvml_power() == {"name": "NVIDIA H200", "power_w": 250.5}


def test_nvml_probe_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert NvmlProbe(FakeNvml()).sample("cuda:0").utilisation == 0.9   # cuda:0 is NVML's GPU 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa")
    assert NvmlProbe(FakeNvml()).sample("cuda:0").utilisation == 0.9
    assert NvmlProbe(FakeNvml()).sample("cuda:1") is None             # not visible


def test_nvml_probe_without_nvml_is_silent():
    probe = NvmlProbe()
    if probe.available:
        pytest.skip("this host has NVML")
    assert probe.sample("cuda:0") is None and probe.read("cuda:0") is None


# -- the observer keeps the latest reading per device -----------------------

class FixedProbe:
    def __init__(self, readings):
        self.readings = readings

    def sample(self, device):
        return self.readings.get(device)


def test_observer_keeps_the_latest_reading_and_tells_the_engine(monkeypatch):
    monkeypatch.setattr(observer, "_latest", {})
    engine = Engine({}, ["cuda:0", "cuda:1", "cpu"])
    seen = []
    real = engine.observe   # (the whole device's figure goes to the engine through observe)
    monkeypatch.setattr(engine, "observe", lambda now, util, mem, **kw: (seen.append((util, mem)), real(now, util, mem, **kw)))
    engine.devices[2].stats.busy_ns = 500
    probe = FixedProbe({"cuda:0": NvmlProbe.Reading(0.6, 4, 8, 100.0), "cuda:1": NvmlProbe.Reading(None, 6, 8, None)})
    last = [(0, 0)] * 3
    observer.sample_devices(engine, probe, last, 1000)
    assert observer.gpu_readings() == probe.readings
    # NVML's utilisation where it answers, else the worker's busy fraction; the fullest memory
    assert seen == [((0.6 + 0.0 + 0.5) / 3, 0.75)] and engine.memory_used == 0.75
    probe.readings.pop("cuda:1")   # NVML stops answering for it: its figures go
    observer.sample_devices(engine, probe, last, 2000)
    assert set(observer.gpu_readings()) == {"cuda:0"}


def test_scheduling_passes_count_those_slower_than_the_queue_lead():
    # A 1 ms lead: passes of 0.2, 0.9, 1.0, 3 and 12 ms; the last two may have left a device waiting.
    # A queued slot then opens as early as the slowest recent pass took, less 10% a pass since.
    passes = SchedulingPasses(1_000_000)
    leads = [passes.counted(int(ms * 1_000_000)) / 1e6 for ms in (0.2, 0.9, 1.0, 3.0, 12.0)]
    assert leads == [1.0, 1.0, 1.0, 3.0, 12.0]
    assert [passes.counted(100_000) / 1e6 for _ in range(3)] == [10.8, 9.72, 8.748]
    got = passes.snapshot()
    assert (got["passes"], got["over_lead"], got["lead_ms"], got["max_ms"], got["opens_ms"]) == (8, 2, 1.0, 12.0, 8.748)
    assert got["seconds"] == pytest.approx(0.0174) and got["mean_ms"] == pytest.approx(2.175)
    page = metrics.render(status(scheduling=got), gpu={})
    assert types_of(page)["dynbatchd_scheduling_over_lead_total"] == "counter"
    values = samples(page)
    assert values["dynbatchd_scheduling_passes_total"] == 8
    assert values["dynbatchd_scheduling_over_lead_total"] == 2
    assert values["dynbatchd_scheduling_seconds_total"] == pytest.approx(0.0174)
