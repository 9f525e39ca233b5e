"""The built-in sentence-embedding runner in stages (prepare, forward, finish) with the bundled
MiniLM: the same embeddings as the model computed directly, through `run` and through the
pipeline; its dtype option, with reduced precision checked against float32 (cosine >= 0.999)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dynbatchd.devices.execution import execute  # noqa: E402
from dynbatchd.devices.pipeline import Pipeline  # noqa: E402
from dynbatchd.devices.runners import (OptionError, SentenceEmbeddingRunner, check_options,  # noqa: E402
                                       default_model_path)

TEXTS = ["A man is playing a guitar.", "Someone strums a guitar.", "The stock market fell sharply today.",
         "short", "a rather longer sentence about the weather in the mountains in winter, with snow and wind"]
CUDA = torch.cuda.is_available()


def loaded(device: str = "cpu", **options) -> SentenceEmbeddingRunner:
    runner = SentenceEmbeddingRunner(device, options)
    runner.load()
    return runner


@pytest.fixture(scope="module")
def fp32() -> SentenceEmbeddingRunner:
    return loaded()


def reference(texts: list[str]) -> np.ndarray:
    """Mean pooling and L2 normalisation written out against transformers, as the runner promises."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    model = AutoModel.from_pretrained(default_model_path()).eval()
    enc = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1).numpy()


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_the_stages_give_the_models_embeddings_as_run_does(fp32):
    tokens = [4] * len(TEXTS)
    staged = fp32.finish(fp32.forward(fp32.prepare(TEXTS, tokens)))
    assert staged.shape == (5, 384) and staged.dtype == np.float32
    np.testing.assert_allclose(staged, reference(TEXTS), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(fp32.run(TEXTS, tokens), staged, rtol=1e-5, atol=1e-6)
    assert fp32.device_ns(fp32.forward(fp32.prepare(TEXTS, tokens))) is None, "on the CPU forward is the device time"


def test_the_pipeline_answers_what_execute_answers_and_isolates_a_non_text_input(fp32):
    batches = [TEXTS[:2], [TEXTS[2], 17, TEXTS[3]], TEXTS[4:]]
    sent = []
    pipe = Pipeline(sent.append)
    for i, inputs in enumerate(batches):
        pipe.submit(i, fp32, "minilm", inputs, [4] * len(inputs))
    pipe.close()
    assert [f.batch_id for f in sent] == [0, 1, 2]
    for finished, inputs in zip(sent, batches):
        serial = execute(fp32, inputs, [4] * len(inputs), "minilm")
        assert finished.run.rejected == serial.rejected
        got = finished.run.batch if finished.run.batch is not None else finished.run.outputs
        want = serial.batch if serial.batch is not None else serial.outputs
        for i in range(len(inputs)):
            if i in serial.errors:
                assert got[i] is None
            else:
                np.testing.assert_allclose(got[i], want[i], rtol=1e-4, atol=1e-5)
    assert sent[1].run.rejected == {1: "sentence-embedding takes text input"}


def test_dtype_is_checked_at_config_time():
    for dtype in ("float32", "float16", "bfloat16"):
        check_options(SentenceEmbeddingRunner, {"dtype": dtype})
    with pytest.raises(OptionError) as bad:
        check_options(SentenceEmbeddingRunner, {"dtype": "float64"})
    assert bad.value.option == "dtype" and "'bfloat16'" in bad.value.rule


def test_bfloat16_on_the_cpu_stays_within_cosine_0_999_of_float32(fp32):
    bf16 = loaded(dtype="bfloat16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    got = bf16.run(TEXTS, [4] * len(TEXTS))
    assert got.dtype == np.float32, "outputs are float32 whatever the dtype"
    assert cosines(got, fp32.run(TEXTS, [4] * len(TEXTS))).min() >= 0.999


def test_float16_is_refused_on_the_cpu_naming_the_option():
    with pytest.raises(OptionError) as refused:
        loaded(dtype="float16")
    assert refused.value.option == "dtype" and "CUDA" in refused.value.rule


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_on_cuda_each_dtype_stays_within_cosine_0_999_of_float32_on_the_cpu(fp32, dtype):
    cuda = loaded("cuda:0", dtype=dtype)
    prepared = cuda.prepare(TEXTS, [4] * len(TEXTS))
    assert all(t.is_pinned() for t in prepared.values())
    output = cuda.forward(prepared)
    got = cuda.finish(output)
    assert cuda.device_ns(output) > 0
    assert cosines(got, fp32.run(TEXTS, [4] * len(TEXTS))).min() >= 0.999
