"""The pipeline's benchmarks run: the CPU one prints its table (SIMULATED), the GPU one says
when there is no CUDA device and exits 0. Figures are not judged here (a shared machine)."""

from __future__ import annotations

import pytest

from benchmarks import gpu, pipeline


def test_the_cpu_pipeline_benchmark_prints_serial_and_pipelined_rates(capsys):
    assert pipeline.main(["--cpu-ms-per-item", "0.01", "--device-ms", "1", "--batch", "4", "--batches", "3"]) == 0
    out = capsys.readouterr().out
    assert "SIMULATED device" in out and "python -m benchmarks.pipeline --cpu-ms-per-item 0.01" in out
    assert "| 0.01 | 0.04 | 1 |" in out


def test_the_gpu_benchmark_without_cuda_says_so_and_exits_0(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the benchmark would run")
    assert gpu.main([]) == 0
    assert "no CUDA device here" in capsys.readouterr().out
