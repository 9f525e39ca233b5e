"""The causal-lm runner on a tiny random Llama built here (no download), alone and under the scheduler."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("transformers")

from dynbatchd.devices.causal_lm import CausalLMRunner  # noqa: E402
from dynbatchd.devices.runners import OptionError, check_options  # noqa: E402
from dynbatchd.generation.batching import ChannelTargets, GenerationScheduler  # noqa: E402
from dynbatchd.generation.kv import KVLedger  # noqa: E402
from dynbatchd.generation.live import Prompt, run_live  # noqa: E402
from dynbatchd.generation.tinymodel import build_tiny_causal_lm  # noqa: E402

PROMPTS = ["w1 w2 a b", "c d e f g h i j k l m n", "w5", "w7 w8 w9 w10 w11 z", "q r s t"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def runner(model_dir):
    r = CausalLMRunner("cpu", {"path": str(model_dir), "max_new_tokens": 12})
    r.load()
    return r


def alone(runner, prompt, n=12):
    """Greedy tokens of one sequence by Hugging Face's own generate (the reference), EOS dropped."""
    import torch

    ids = torch.tensor([runner.encode(prompt)])
    out = runner.model.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()
    return list(itertools.takewhile(lambda t: t != runner.eos, out))


def test_continuous_batching_gives_the_same_greedy_tokens_as_one_at_a_time(runner):
    reference = [alone(runner, p) for p in PROMPTS]
    runner.add("a", PROMPTS[0])
    runner.add("b", PROMPTS[1])
    runner.prefill(["a", "b"])
    runner.decode_step(["a", "b"])
    runner.decode_step(["a", "b"])
    ids = ["a", "b", "c", "d", "e"]
    for seq_id, prompt in zip(ids[2:], PROMPTS[2:]):                   # join mid-generation
        runner.add(seq_id, prompt)
    runner.prefill(ids[2:])
    running = [i for i in ids if not runner.sequences[i].finished]
    while running:
        runner.decode_step(running)
        running = [i for i in running if not runner.sequences[i].finished]
    got = [runner.remove(i).generated for i in ids]
    assert got == reference
    assert runner.kv_tokens() == 0 and not runner.sequences


def test_cancel_frees_the_sequence_kv_at_once(runner):
    runner.add("x", PROMPTS[1])
    runner.add("y", PROMPTS[0])
    runner.prefill(["x", "y"])
    runner.decode_step(["x", "y"])
    held = runner.kv_tokens()
    assert held == len(runner.encode(PROMPTS[1])) + len(runner.encode(PROMPTS[0])) + 2
    runner.remove("x")
    assert runner.kv_tokens() == len(runner.encode(PROMPTS[0])) + 1
    runner.decode_step(["y"])                          # the others go on
    runner.remove("y")
    assert runner.kv_tokens() == 0


def test_stop_sequence_ends_generation_and_is_cut_from_the_text(runner):
    full = runner.generate([PROMPTS[0]])[0]
    words = full.split()
    assert len(words) >= 4
    stop = words[3]
    runner.add("s", PROMPTS[0], stop=[stop])
    runner.prefill(["s"])
    while not runner.sequences["s"].finished:
        runner.decode_step(["s"])
    seq = runner.remove("s")
    assert seq.finished == "stop" and stop not in seq.text and full.startswith(seq.text)
    assert len(seq.generated) < 12


def test_sampling_is_seeded(runner):
    def sample(seed):
        runner.add("p", PROMPTS[3], temperature=1.0, top_k=20, seed=seed, max_new_tokens=10)
        runner.prefill(["p"])
        while not runner.sequences["p"].finished:
            runner.decode_step(["p"])
        return runner.remove("p").generated

    assert sample(7) == sample(7)
    assert any(sample(s) != sample(7) for s in (1, 2, 3))


def test_under_the_scheduler_with_preemption_the_tokens_stay_exact(runner):
    """A KV budget that forces a realtime request to preempt bulk ones: the bulk ones recompute
    and still produce the tokens they produce alone."""
    reference = {f"p{i}": alone(runner, p, 8) for i, p in enumerate(PROMPTS)}
    per_token = 1
    channels = {"realtime": ChannelTargets("realtime", priority=0), "bulk": ChannelTargets("bulk", priority=2)}
    sched = GenerationScheduler(KVLedger(40 * per_token, per_token), channels)
    prompts = [Prompt(f"p{i}", "bulk" if i < 3 else "realtime", p, 8, after_step=0 if i < 3 else 3) for i, p in enumerate(PROMPTS)]
    ticks = itertools.count()
    texts, ended = run_live(runner, sched, prompts, clock=lambda: float(next(ticks)))
    assert sched.preemptions >= 1 and sched.ledger.over_budget == 0 and sched.ledger.peak_bytes <= 40
    assert {e.id for e in ended} == set(reference)
    for e in ended:
        assert e.reason in ("length", "stop")
        assert texts[e.id] == runner.tokenizer.decode(reference[e.id], skip_special_tokens=True)
    assert not runner.sequences and runner.kv_tokens() == 0


def test_the_one_shot_run_answers_each_input_with_its_text(runner):
    texts = runner.run([PROMPTS[0], PROMPTS[2]], [4, 1])
    assert texts == [runner.tokenizer.decode(alone(runner, p)) for p in (PROMPTS[0], PROMPTS[2])]
    assert not runner.sequences
    assert runner.check("w1") is None and runner.check("  ") and runner.check([1, 2])


def test_options_are_checked_without_loading(model_dir, tmp_path):
    check_options(CausalLMRunner, {"path": str(model_dir), "dtype": "bfloat16", "stop": ["\n"], "temperature": 0.7})
    with pytest.raises(OptionError, match="required"):
        check_options(CausalLMRunner, {})
    with pytest.raises(OptionError, match="dtype"):
        check_options(CausalLMRunner, {"path": str(model_dir), "dtype": "int3"})
    with pytest.raises(OptionError, match="config.json"):
        check_options(CausalLMRunner, {"path": str(tmp_path)})


def test_a_sequence_longer_than_the_model_context_is_refused_when_added(runner):
    limit = runner.max_context
    assert limit == 512   # the tiny model's max_position_embeddings
    with pytest.raises(ValueError, match=r"longer than the model's context \(512 tokens\)"):
        runner.add("too-long", "w1 w2", max_new_tokens=limit - 1)
    assert "too-long" not in runner.sequences
    runner.add("fits", "w1 w2", max_new_tokens=limit - 2)
    runner.remove("fits")
