"""The sentence-embedding runner's opt-in compiled shapes (issue 24): `compile` and `length_buckets`
checked at config time, padding to a bucket that changes no embedding, and torch.compile on the
CPU matching float32 eager embeddings (cosine >= 0.999 per row) with the bundled MiniLM."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from dynbatchd.devices import embedding
from dynbatchd.devices.embedding import SentenceEmbeddingRunner, batch_bucket, bucket
from dynbatchd.devices.pipeline import Pipeline
from dynbatchd.devices.runners import OptionError, check_options

TEXTS = ["A man is playing a guitar.", "Someone strums a guitar.", "The stock market fell sharply today.",
         "short", "a rather longer sentence about the weather in the mountains in winter"]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def loaded(**options) -> SentenceEmbeddingRunner:
    runner = SentenceEmbeddingRunner("cpu", options)
    runner.load()
    return runner


def test_buckets_round_up_and_batches_pad_to_a_power_of_two():
    assert [bucket(n, (16, 32)) for n in (1, 16, 17, 32, 40)] == [16, 16, 32, 32, 40]
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 32, 33)] == [2, 2, 4, 8, 32, 64]


def test_compile_and_length_buckets_are_checked_at_config_time(monkeypatch):
    for mode in ("off", "torch-compile"):
        check_options(SentenceEmbeddingRunner, {"compile": mode, "length_buckets": [16, 64]})
    for bad in ([], [32, 16], [16, 16], [0], ["16"], 16):
        with pytest.raises(OptionError) as refused:
            check_options(SentenceEmbeddingRunner, {"length_buckets": bad})
        assert refused.value.option == "length_buckets"
    with pytest.raises(OptionError, match="expected one of"):
        check_options(SentenceEmbeddingRunner, {"compile": "inductor"})
    monkeypatch.setattr(embedding, "has_cuda_device", lambda: False)
    with pytest.raises(OptionError) as refused:
        check_options(SentenceEmbeddingRunner, {"compile": "cuda-graphs"})
    assert refused.value.option == "compile" and "needs a CUDA device" in refused.value.rule
    monkeypatch.setattr(embedding, "has_cuda_device", lambda: True)
    check_options(SentenceEmbeddingRunner, {"compile": "cuda-graphs"})


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def fp32() -> SentenceEmbeddingRunner:
    return loaded()


def test_cuda_graphs_on_a_cpu_device_is_refused_at_load_naming_the_option():
    with pytest.raises(OptionError) as refused:
        loaded(compile="cuda-graphs")
    assert refused.value.option == "compile" and "cpu" in refused.value.rule


def test_padding_to_a_bucket_changes_no_embedding(fp32, monkeypatch):
    padded = SentenceEmbeddingRunner("cpu", {})
    padded.__dict__.update(fp32.__dict__)
    padded.buckets = (32, 256)
    prepared = padded.prepare(TEXTS[:1], [8])
    assert prepared["input_ids"].shape == (2, 32), "1 row padded to 2, the tokens to the bucket of 32"
    got = padded.finish(padded.forward(prepared))
    assert got.shape == (1, 384)
    assert cosines(got, fp32.run(TEXTS[:1], [8])).min() >= 0.9999


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                    reason="torch.compile on the CPU needs a C compiler (gcc), and none is installed")
def test_torch_compile_on_the_cpu_matches_float32_eager_within_cosine_0_999(fp32):
    compiled = loaded(compile="torch-compile", length_buckets=[32], max_tokens=32)   # one bucket: a fast test
    assert compiled.buckets == (32,)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    for texts in (TEXTS, TEXTS[:2], TEXTS[:3], TEXTS[:1]):   # the buckets were warmed at load
        got = compiled.run(texts, [8] * len(texts))
        assert got.shape == (len(texts), 384) and got.dtype == np.float32
        assert cosines(got, fp32.run(texts, [8] * len(texts))).min() >= 0.999
    assert counters["stats"]["unique_graphs"] == graphs, "a batch after load compiled again"
    sent = []   # and in a pipelined worker, whose device stage runs in a thread of its own
    pipe = Pipeline(sent.append)
    pipe.submit(1, compiled, "minilm", TEXTS[:3], [8] * 3)
    pipe.close()
    assert cosines(sent[0].run.batch, fp32.run(TEXTS[:3], [8] * 3)).min() >= 0.999


def test_bfloat16_with_buckets_on_the_cpu_matches_float32_eager_within_cosine_0_999(fp32):
    bf16 = SentenceEmbeddingRunner("cpu", {"dtype": "bfloat16"})
    bf16.load()
    bf16.buckets = (16, 64, 256)   # bucketed padding, eager: what compile adds besides the compiler
    got = bf16.run(TEXTS, [8] * len(TEXTS))
    assert cosines(got, fp32.run(TEXTS, [8] * len(TEXTS))).min() >= 0.999
