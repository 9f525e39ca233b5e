"""The adaptive sizer's memory figure is what the daemon's own batches need (torch's peak
*allocated*, reported by the worker per batch), not NVML's "used" for the whole GPU, which holds
the weights, torch's allocator cache and other processes and does not fall when batches shrink.

Fake clock, fake NVML, fake torch: no GPU needed. On the old code (the sizer fed NVML's fraction)
the first two tests fail: a GPU 85% "used" shrank every channel to a batch of 1 and kept it there.
"""

from __future__ import annotations

import sys
import types

import msgspec

from dynbatchd import protocol as P
from dynbatchd import observer
from dynbatchd.devices.execution import Execution
from dynbatchd.devices.worker import encode_result
from dynbatchd.engine import Engine
from dynbatchd.memory import GIB, batch_memory_fraction, batch_peak_bytes
from dynbatchd.scheduler.sizing import AdaptiveSizer
from dynbatchd.telemetry import NvmlProbe

TOTAL = 80 * GIB
SECOND = 10**9


class Gpu:
    """One 80 GiB GPU: NVML's "used" is the weights plus torch's reserved pool, which grew to what
    the largest batch ever needed and is never given back; torch's allocated peak per batch is the
    weights plus what a batch of the sizer's current limit needs."""

    def __init__(self, weights_gib: float, per_item_gib: float, reserved_gib: float):
        self.weights, self.per_item, self.reserved = weights_gib * GIB, per_item_gib * GIB, reserved_gib * GIB

    def sample(self, device):
        return NvmlProbe.Reading(0.5, int(self.weights + self.reserved), TOTAL, 300.0)

    def peak(self, batch: int) -> int:
        return int(self.weights + batch * self.per_item)


def run(monkeypatch, gpu: Gpu, beats: int, *, report: bool = True) -> AdaptiveSizer:
    """`beats` observer beats a second apart; after each, a batch of the sizer's limit runs and
    (if `report`) its worker reports its peak allocated bytes, as Daemon._on_result keeps it."""
    monkeypatch.setattr(observer, "_latest", {})
    engine = Engine({}, ["cuda:0"])
    sizer = AdaptiveSizer(16, cooldown_ms=0)
    monkeypatch.setattr(engine, "observe", lambda now, util, mem, **_: sizer.observe(
        utilisation=util, memory=mem, queue_len=0, now_ns=now))
    last = [(0, 0)]
    for beat in range(1, beats + 1):
        if report:
            engine.devices[0].stats.batch_memory[0] = gpu.peak(sizer.max_batch())
        observer.sample_devices(engine, gpu, last, beat * SECOND)
    return sizer


def test_weights_and_allocator_cache_at_85_percent_do_not_shrink_the_batch(monkeypatch):
    # 60 GiB of weights (75%) + 8 GiB the allocator keeps: NVML says 85% used; a batch of 16 needs 4 GiB
    gpu = Gpu(weights_gib=60, per_item_gib=0.25, reserved_gib=8)
    assert gpu.sample("cuda:0").memory_fraction == 0.85
    sizer = run(monkeypatch, gpu, beats=60)
    assert sizer.max_batch() == 16 and sizer.changes == 0


def test_batches_that_do_fill_memory_shrink_it_until_they_fit_then_it_holds(monkeypatch):
    # 40 GiB of weights, 2.5 GiB per item: a batch of 16 peaks at 80 GiB (100%); of 9, 62.5 GiB (78%).
    # NVML's "used" stays at 95% whatever the batch (the pool keeps the 36 GiB it once reserved).
    gpu = Gpu(weights_gib=40, per_item_gib=2.5, reserved_gib=36)
    sizer = run(monkeypatch, gpu, beats=120)
    assert sizer.max_batch() == 9 and sizer.changes == 2   # 16 -> 12 -> 9, then nothing more
    assert gpu.peak(9) / TOTAL < 0.80 < gpu.peak(12) / TOTAL


def test_without_a_torch_figure_the_sizer_falls_back_to_nvml(monkeypatch):
    """A GPU runner that is not torch reports nothing: NVML's fraction is all there is (as before)."""
    gpu = Gpu(weights_gib=60, per_item_gib=0.25, reserved_gib=8)
    assert run(monkeypatch, gpu, beats=60, report=False).max_batch() == 1


def test_feeders_add_up_and_the_health_score_keeps_nvmls_headroom(monkeypatch):
    gpu = Gpu(weights_gib=20, per_item_gib=0.25, reserved_gib=48)   # NVML: 85% used
    monkeypatch.setattr(observer, "_latest", {})
    engine = Engine({}, ["cuda:0"])
    seen = []
    real = engine.observe   # (the whole device's figure goes to the engine through observe)
    monkeypatch.setattr(engine, "observe", lambda now, util, mem, **kw: (seen.append(mem), real(now, util, mem, **kw)))
    engine.devices[0].stats.batch_memory.update({0: gpu.peak(16), 1: gpu.peak(4)})   # two feeders, two weight copies
    observer.sample_devices(engine, gpu, [(0, 0)], SECOND)
    assert engine.memory_used == 0.85                    # the whole device's headroom, for the health score
    assert seen == [(24 + 21) / 80]                      # what the daemon's batches hold, for the sizers


def test_batch_memory_fraction():
    assert batch_memory_fraction({}, TOTAL) is None
    assert batch_memory_fraction({0: 0}, TOTAL) is None
    assert batch_memory_fraction({0: 8 * GIB}, None) is None
    assert batch_memory_fraction({0: 8 * GIB, 1: 16 * GIB}, TOTAL) == 0.3
    assert batch_memory_fraction({0: 90 * GIB}, TOTAL) == 1.0


def test_batch_peak_bytes_reads_torch_allocated_and_resets_it(monkeypatch):
    calls = []
    cuda = types.SimpleNamespace(is_initialized=lambda: True,
                                 max_memory_allocated=lambda d: calls.append(("peak", d)) or 5 * GIB,
                                 memory_reserved=lambda d: 70 * GIB,
                                 reset_peak_memory_stats=lambda d: calls.append(("reset", d)))
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert batch_peak_bytes("cuda:1") == 5 * GIB
    assert calls == [("peak", "cuda:1"), ("reset", "cuda:1")]
    assert batch_peak_bytes("cpu") == 0
    cuda.is_initialized = lambda: False   # torch imported, CUDA never used by this worker
    assert batch_peak_bytes("cuda:0") == 0
    cuda.is_initialized = lambda: (_ for _ in ()).throw(RuntimeError("no driver"))
    assert batch_peak_bytes("cuda:0") == 0
    monkeypatch.delitem(sys.modules, "torch")
    assert batch_peak_bytes("cuda:0") == 0


def test_the_worker_reports_it_and_an_old_worker_s_result_still_decodes():
    run_ = Execution(2)
    run_.outputs = [1.0, 2.0]
    [header] = encode_result(7, run_, 1000, False, 0, 3 * GIB)
    result = P.worker_decoder.decode(header)
    assert isinstance(result, P.BatchResult) and result.memory_bytes == 3 * GIB
    old = msgspec.msgpack.encode(["result", 7, 1000, None, [1.0, 2.0]])   # no memory_bytes on the wire
    assert P.worker_decoder.decode(old).memory_bytes == 0
