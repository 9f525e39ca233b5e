"""The torchscript and exported runners: the tests export a tiny module themselves (torch.jit.script,
torch.jit.trace, torch.export with and without a dynamic batch dimension), serve it through the
worker's execute path and through a daemon, and compare every output with the eager module's.
Their options are checked at config time like every other key."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import start_daemon  # noqa: E402
from dynbatchd.client import Client  # noqa: E402
from dynbatchd.config import ConfigError, parse  # noqa: E402
from dynbatchd.devices.exported import ExportedRunner, TorchScriptRunner  # noqa: E402
from dynbatchd.devices.worker import execute  # noqa: E402
from dynbatchd.plugins import Plugins  # noqa: E402
from dynbatchd.validation import validate_config  # noqa: E402


class Tiny(torch.nn.Module):
    """Two inputs of different dtypes, so the stacking and the dtype conversion both matter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x, shift):
        return torch.tanh(self.lin(x)) + shift.unsqueeze(-1).to(torch.float32)


class One(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x):
        return (self.lin(x), x.sum(-1))   # a tuple: the first output is served


TWO_INPUTS = [{"name": "x", "dtype": "float32", "shape": [4]}, {"name": "shift", "dtype": "int64"}]


def rows(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal(4).astype(np.float32).tolist(), "shift": int(rng.integers(0, 5))}
            for _ in range(n)]


def eager(module, items: list[dict]) -> np.ndarray:
    with torch.no_grad():
        x = torch.tensor([i["x"] for i in items], dtype=torch.float32)
        shift = torch.tensor([i["shift"] for i in items], dtype=torch.int64)
        return module(x, shift).numpy()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exported")
    tiny, one = Tiny().eval(), One().eval()
    example = (torch.zeros(4, 4), torch.zeros(4, dtype=torch.int64))
    out = {"tiny": tiny, "one": one}
    torch.jit.save(torch.jit.script(tiny), tmp / "scripted.pt")
    torch.jit.save(torch.jit.trace(tiny, example), tmp / "traced.pt")
    batch = torch.export.Dim("batch", min=1, max=1024)
    torch.export.save(torch.export.export(tiny, example, dynamic_shapes=({0: batch}, {0: batch})),
                      tmp / "dynamic.pt2")
    torch.export.save(torch.export.export(tiny, example), tmp / "static4.pt2")   # batch size 4 only
    torch.export.save(torch.export.export(one, (torch.zeros(2, 4),), dynamic_shapes=({0: batch},)),
                      tmp / "one.pt2")
    out.update({name: str(tmp / f) for name, f in [("scripted", "scripted.pt"), ("traced", "traced.pt"),
                                                   ("dynamic", "dynamic.pt2"), ("static4", "static4.pt2"),
                                                   ("one_file", "one.pt2")]})
    return out


def served(runner_class, options: dict, items: list) -> np.ndarray:
    runner = runner_class("cpu", options)
    runner.load()
    run = execute(runner, items, [0] * len(items), "tiny")
    assert not run.errors, run.errors
    return run.batch


@pytest.mark.parametrize("runner_class,key,options", [
    (TorchScriptRunner, "scripted", {}),
    (TorchScriptRunner, "traced", {"batch_size": 4}),   # traced at batch 4: padded or chunked to it
    (ExportedRunner, "dynamic", {}),
    (ExportedRunner, "static4", {"batch_size": 4}),
])
@pytest.mark.parametrize("n", [1, 4, 6])
def test_the_program_answers_what_the_eager_module_answers(files, runner_class, key, options, n):
    items = rows(n, seed=n)
    got = served(runner_class, {"path": files[key], "inputs": TWO_INPUTS, **options}, items)
    np.testing.assert_allclose(got, eager(files["tiny"], items), rtol=1e-5, atol=1e-6)


def test_one_input_takes_a_tensor_or_a_list_and_the_first_output_of_a_tuple_is_served(files):
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(4).astype(np.float32) for _ in range(3)]
    got = served(ExportedRunner, {"path": files["one_file"]}, [arrays[0], arrays[1].tolist(), arrays[2]])
    with torch.no_grad():
        want = files["one"](torch.from_numpy(np.stack(arrays)))[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_request_the_program_cannot_take_is_refused_alone(files):
    runner = TorchScriptRunner("cpu", {"path": files["scripted"], "inputs": TWO_INPUTS})
    runner.load()
    good = rows(2)
    items = [good[0], "some text", {"x": [1.0, 2.0], "shift": 1}, {"x": [0.0] * 4}, good[1]]
    run = execute(runner, items, [0] * len(items), "tiny")
    assert sorted(run.rejected) == [1, 2, 3]
    assert "shape [4]" in run.rejected[2] and "exactly the inputs x, shift" in run.rejected[3]
    np.testing.assert_allclose(np.stack([run.outputs[0], run.outputs[4]]), eager(files["tiny"], good),
                               rtol=1e-5, atol=1e-6)


def config_with(options: str) -> str:
    return f"""
[models.m]
runner = "exported"
options = {options}
[channels.standard]
max_batch = 8
window_ms = 2
"""


@pytest.mark.parametrize("options,key,rule", [
    ("{}", "models.m.options.path", "required"),
    ('{ path = "/nonexistent/model.pt2" }', "models.m.options.path", "no such file"),
    ('{ path = "FILE", batch_sise = 4 }', "models.m.options.batch_sise", "did you mean `batch_size`"),
    ('{ path = "FILE", batch_size = 0 }', "models.m.options.batch_size", "integer >= 1"),
    ('{ path = "FILE", inputs = [{ name = "x", dtype = "float8" }] }', "models.m.options.inputs",
     "[0].dtype: expected one of float32"),
    ('{ path = "FILE", inputs = [{ name = "x" }, { name = "x" }] }', "models.m.options.inputs",
     "declared twice"),
    ('{ path = "FILE", inputs = [{ name = "x", shape = [0] }] }', "models.m.options.inputs", "[0].shape"),
])
def test_bad_options_are_config_errors_naming_the_key_and_the_rule(files, options, key, rule):
    import tomllib

    config = parse(tomllib.loads(config_with(options.replace("FILE", files["dynamic"]))), "t.toml")
    with pytest.raises(ConfigError) as caught:
        validate_config(config, Plugins.load())
    assert caught.value.key == key and rule in caught.value.rule, str(caught.value)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, files):
    """One daemon for the end-to-end tests: a scripted file, a traced one of batch size 4 (with its
    declared inputs) and an exported one of one input; the HTTP door on."""
    from conftest import free_port

    port = free_port()
    inputs = '[{ name = "x", dtype = "float32", shape = [4] }, { name = "shift", dtype = "int64" }]'
    body = f"""
        [models.ts]
        runner = "torchscript"
        options = {{ path = "{files['scripted']}", inputs = {inputs} }}
        [models.tr]
        runner = "torchscript"
        options = {{ path = "{files['traced']}", batch_size = 4, inputs = {inputs} }}
        [models.ep]
        runner = "exported"
        options = {{ path = "{files['one_file']}" }}
        [channels.standard]
        max_batch = 8
        window_ms = 5
        [http]
        listen = "127.0.0.1:{port}"
    """
    running = start_daemon(tmp_path_factory.mktemp("exported-daemon"), body)
    running.http = f"http://127.0.0.1:{port}"
    yield running
    running.stop()


def test_a_daemon_serves_a_torchscript_file_and_an_exported_one(daemon, files):
    items = rows(5, seed=11)
    with Client(daemon.endpoint, timeout=60) as client:
        futures = [client.submit("ts", item) for item in items]
        got = np.stack([np.asarray(f.result().output) for f in futures])
        x = np.asarray([i["x"] for i in items], np.float32)
        tensors = [client.submit("ep", row) for row in x]
        got_ep = np.stack([np.asarray(f.result().output) for f in tensors])
    np.testing.assert_allclose(got, eager(files["tiny"], items), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        np.testing.assert_allclose(got_ep, files["one"](torch.from_numpy(x))[0].numpy(), rtol=1e-5, atol=1e-6)


def test_kserve_v2_feeds_a_program_of_two_named_inputs_over_http(daemon, files):
    import json
    import urllib.request

    def call(path, payload=None):
        data = json.dumps(payload).encode() if payload is not None else None
        request = urllib.request.Request(daemon.http + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.loads(reply.read())

    items = rows(3, seed=21)
    assert call("/v2/models/ep")["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1]}]
    assert call("/v2/models/tr")["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]},
                                               {"name": "shift", "datatype": "INT64", "shape": [-1]}]
    reply = call("/v2/models/tr/infer", {"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [3, 4], "data": [v for i in items for v in i["x"]]},
        {"name": "shift", "datatype": "INT64", "shape": [3], "data": [i["shift"] for i in items]}]})
    [out] = reply["outputs"]
    assert out["shape"] == [3, 3]
    np.testing.assert_allclose(np.asarray(out["data"], np.float32).reshape(3, 3), eager(files["tiny"], items),
                               rtol=1e-5, atol=1e-6)


def test_the_sentence_embedding_runner_takes_any_local_encoder_directory(tmp_path):
    """Not only the shipped MiniLM: a tiny BERT saved with save_pretrained, beside MiniLM's tokenizer."""
    transformers = pytest.importorskip("transformers")
    from dynbatchd.devices.runners import SentenceEmbeddingRunner, default_model_path

    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_path())
    torch.manual_seed(5)
    model = transformers.BertModel(transformers.BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32)).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    texts = ["a short one", "a somewhat longer sentence than the first"]
    got = served(SentenceEmbeddingRunner, {"path": str(tmp_path), "normalize": False}, texts)
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    np.testing.assert_allclose(got, ((hidden * mask).sum(1) / mask.sum(1)).numpy(), rtol=1e-5, atol=1e-6)
    assert got.shape == (2, 16)


@pytest.mark.parametrize("make,rule", [
    (lambda tmp: str(tmp / "missing"), "no such directory"),
    (lambda tmp: str(tmp), "has no config.json"),
])
def test_an_encoder_path_that_is_not_a_model_directory_is_a_config_error(tmp_path, make, rule):
    import tomllib

    text = config_with(f'{{ path = "{make(tmp_path)}" }}').replace('"exported"', '"sentence-embedding"')
    with pytest.raises(ConfigError) as caught:
        validate_config(parse(tomllib.loads(text), "t.toml"), Plugins.load())
    assert caught.value.key == "models.m.options.path" and rule in caught.value.rule, str(caught.value)


def test_plan_says_a_program_file_has_no_config_json_to_plan_from(files):
    import tomllib

    from dynbatchd.cli.plan import PlanError, resolve_model

    config = parse(tomllib.loads(config_with(f'{{ path = "{files["dynamic"]}" }}')), "t.toml")
    with pytest.raises(PlanError, match="exported program, which has no config.json"):
        resolve_model(config, "m")
