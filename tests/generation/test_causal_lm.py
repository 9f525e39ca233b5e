"""The causal-lm runner on a tiny random Llama built here (no download), alone and under the
worker's own loop (`GenerationLoop`, a counter clock): batched tokens equal one-at-a-time ones."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("transformers")

from dynbatchd.devices.causal_lm import CausalLMRunner  # noqa: E402
from dynbatchd.devices.runners import OptionError, check_options  # noqa: E402
from dynbatchd import protocol as P  # noqa: E402
from dynbatchd.generation.batching import ChannelTargets  # noqa: E402
from dynbatchd.generation.replay import TimedJob, replay  # noqa: E402
from dynbatchd.generation.serving import GenerationLoop, scheduler_for  # noqa: E402
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


class Counter:
    """A clock (ms) that moves one millisecond at each reading; `sleep` moves it on."""

    def __init__(self):
        self.ms = 0.0

    def __call__(self):
        self.ms += 1.0
        return self.ms

    def sleep(self, ms):
        self.ms += max(0.0, ms)


def ends_of(messages):
    return {m.job: m for m in messages if isinstance(m, P.GenEnd)}


def test_under_the_loop_with_preemption_the_tokens_stay_exact(runner):
    """A KV budget that forces realtime jobs to preempt bulk ones: the bulk ones recompute and
    still produce the tokens they produce alone; the ledger never passes the budget."""
    reference = {i: alone(runner, p, 8) for i, p in enumerate(PROMPTS)}
    loop = GenerationLoop(runner, scheduler_for({"kv_budget_tokens": 40}), Counter())
    jobs = [P.GenerateJob(i, "tiny", p, {"max_new_tokens": 8}, "bulk" if i < 3 else "realtime", 0 if i < 3 else 2)
            for i, p in enumerate(PROMPTS)]
    messages = []
    for job in jobs[:3]:
        loop.take(job)
    for _ in range(3):
        messages += loop.step()
    for job in jobs[3:]:                              # join mid-generation, of a higher class
        loop.take(job)
    while loop.busy:
        messages += loop.step()
    ends, ledger = ends_of(messages), loop.scheduler.ledger
    assert loop.scheduler.preemptions >= 1 and ledger.over_budget == 0 and ledger.peak_bytes <= 40
    assert set(ends) == set(reference)
    for n, end in ends.items():
        assert end.reason in ("length", "stop")
        assert end.text == runner.tokenizer.decode(reference[n], skip_special_tokens=True)
    streamed = {}
    for m in messages:
        for job, text, _ in (m.items if isinstance(m, P.GenTokens) else ()):
            streamed[job] = streamed.get(job, "") + text
    assert streamed == {n: e.text for n, e in ends.items() if e.text}
    assert not runner.sequences and runner.kv_tokens() == 0


@pytest.mark.parametrize("mode", ["continuous", "static"])
def test_replayed_arrivals_give_one_at_a_time_texts_and_count_ttft_from_arrival(runner, mode):
    """Open-loop arrivals on a counter clock (the CPU benchmark's driver): every job ends once with
    its one-at-a-time text in both modes; a job taken late has the wait in its TTFT."""
    targets = {"standard": ChannelTargets("standard", 0, ttft_ms=1e9, tpot_ms=1e9)}
    jobs = [TimedJob(10.0 * i, P.GenerateJob(i, "tiny", p, {"max_new_tokens": 6}, "standard"))
            for i, p in enumerate(PROMPTS)]
    clock = Counter()
    report = replay(GenerationLoop(runner, scheduler_for({"mode": mode}), clock), jobs, clock, clock.sleep)
    ends = {e.job: e for e in report.ends}
    assert set(ends) == set(range(len(PROMPTS))) and report.mode == mode
    for n, p in enumerate(PROMPTS):
        assert ends[n].text == runner.tokenizer.decode(alone(runner, p, 6), skip_special_tokens=True)
        assert report.ttft_ms(ends[n]) == ends[n].ttft_us / 1000 + report.lag_ms[n] >= ends[n].ttft_us / 1000
    assert report.kv["kv_over_budget"] == 0 and report.kv["kv_in_use_bytes"] == 0
    report.targets = targets
    assert report.met_count == len(PROMPTS)
    assert report.goodput_tokens_per_s == report.tokens_per_s > 0
    report.targets = {"standard": ChannelTargets("standard", 0, ttft_ms=0.0, tpot_ms=1e9)}
    assert report.met_count == 0 and report.goodput_tokens_per_s == 0
    assert not runner.sequences


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
