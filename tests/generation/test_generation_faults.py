"""Faults a live fuzzing pass found in generation, each with the test that failed before its fix:
a tiny positive temperature (logits / T overflowed, softmax NaN, torch.multinomial raised and the
worker failed every stream of the step), one sequence's failed token failing its whole step, and
thousands of stop strings slowing every stream beside them (now at most 16 of 256 characters)."""

from __future__ import annotations

import itertools
import random

import msgspec
import pytest
import zmq

pytest.importorskip("transformers")

from conftest import start_tiny_generative  # noqa: E402

from dynbatchd import protocol as P  # noqa: E402
from dynbatchd.devices import causal_lm  # noqa: E402
from dynbatchd.devices.causal_lm import CausalLMRunner, GenSequence, _held_tail, _pick  # noqa: E402
from dynbatchd.generation.serving import GenerationLoop, scheduler_for  # noqa: E402
from dynbatchd.generation.tinymodel import build_tiny_causal_lm  # noqa: E402

TINY_TEMPERATURES = [5e-324, 1e-308, 1e-300, 1e-40]
AT_THE_CAP = [f"<never{i}>".ljust(P.MAX_STOP_CHARS, "#") for i in range(P.MAX_STOP_STRINGS)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-faults"))


@pytest.fixture(scope="module")
def runner(model_dir):
    r = CausalLMRunner("cpu", {"path": str(model_dir), "max_new_tokens": 12})
    r.load()
    return r


def run_alone(runner, prompt, **options):
    """One sequence to its end, by the runner's own steps: its text."""
    runner.add("one", prompt, **options)
    try:
        runner.prefill(["one"])
        while not runner.sequences["one"].finished:
            runner.decode_step(["one"])
    finally:
        seq = runner.remove("one")
    return seq.text


# -- 1. a tiny temperature ---------------------------------------------------------------------

@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_a_tiny_positive_temperature_generates_the_greedy_text(runner, temperature):
    greedy = run_alone(runner, "w1 w2 a b")
    assert run_alone(runner, "w1 w2 a b", temperature=temperature, seed=3) == greedy


def test_a_tiny_temperature_in_the_runner_options_generates_too(model_dir, runner):
    configured = CausalLMRunner("cpu", {"path": str(model_dir), "max_new_tokens": 8, "temperature": 1e-308})
    configured.load()
    assert configured.generate(["w1 w2 a b"]) == [run_alone(runner, "w1 w2 a b", max_new_tokens=8)]


@pytest.mark.parametrize("logits, top", [([0.0, 1.0, float("inf"), 2.0], 2), ([0.0, float("nan"), 1.0], None),
                                         ([float("-inf")] * 3, None)])
def test_a_row_whose_probabilities_are_not_finite_takes_its_top_token(logits, top):
    import torch

    row = torch.tensor(logits)
    seq = GenSequence([1], 4, (), 1.0, 0, torch.Generator().manual_seed(0))
    token = _pick(row, seq)   # torch.multinomial raised on these
    assert token == (top if top is not None else int(torch.argmax(row)))


def test_normal_temperatures_sample_as_before(runner):
    """Same seeds, same text: the floor and the finiteness check change nothing above the floor."""
    import torch

    seq = GenSequence([1], 4, (), 0.7, 20, torch.Generator().manual_seed(11))
    logits = torch.randn(86, generator=torch.Generator().manual_seed(5)) * 4
    reference = torch.Generator().manual_seed(11)
    scaled = logits / 0.7
    scaled = scaled.masked_fill(scaled < torch.topk(scaled, 20).values[-1], float("-inf"))
    expected = [int(torch.multinomial(torch.softmax(scaled, -1), 1, generator=reference)) for _ in range(20)]
    assert [_pick(logits, seq) for _ in range(20)] == expected


def test_one_sequences_failed_token_ends_it_alone_and_the_others_go_on(runner, monkeypatch):
    """A token that cannot be picked (here: made to raise) ends that job with an error; the others
    of the same steps end well, with their one-at-a-time text, and no KV is left behind."""
    real = causal_lm._pick

    def pick(logits, seq):
        if seq.top_k == 7:   # the one marked to fail
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, seq)

    monkeypatch.setattr(causal_lm, "_pick", pick)
    prompts = ["w1 w2 a b", "c d e f", "w5"]
    expected = {n: run_alone(runner, p, max_new_tokens=6) for n, p in enumerate(prompts)}
    clock = itertools.count(1.0)
    loop = GenerationLoop(runner, scheduler_for({}), lambda: next(clock))
    for n, prompt in enumerate(prompts):
        loop.take(P.GenerateJob(n, "tiny", prompt, {"max_new_tokens": 6}, "standard"))
    loop.take(P.GenerateJob(9, "tiny", "w7 w8", {"max_new_tokens": 6, "temperature": 1.0, "top_k": 7}, "standard"))
    messages = []
    while loop.busy:
        messages += loop.step()
    ends = {m.job: m for m in messages if isinstance(m, P.GenEnd)}
    assert ends[9].reason == "error" and "RuntimeError" in ends[9].message
    assert {n: ends[n].text for n in expected} == expected
    assert all(ends[n].reason in ("length", "stop") for n in expected)
    assert not any(job == 9 for m in messages if isinstance(m, P.GenTokens) for job, _, _ in m.items)
    assert not runner.sequences and loop.scheduler.ledger.in_use_bytes == 0


# -- 3. stop strings: at most 16, of at most 256 characters ------------------------------------

def test_stop_strings_are_capped_in_number_and_length_naming_generate_stop():
    assert P.check_generate({"stop": AT_THE_CAP}) is None
    many = P.check_generate({"stop": ["zq%017d" % i for i in range(45000)]})
    assert many == f"generate.stop must be at most {P.MAX_STOP_STRINGS} strings, got 45000"
    long = P.check_generate({"stop": ["x", "w" * (P.MAX_STOP_CHARS + 1)]})
    assert long == (f"generate.stop strings must be at most {P.MAX_STOP_CHARS} characters each, "
                    f"got one of {P.MAX_STOP_CHARS + 1}")
    assert P.check_generate({"stop": [""]}).startswith("generate.stop must be a list of non-empty strings")


def test_the_runners_stop_option_has_the_requests_cap():
    assert causal_lm.stop_strings(AT_THE_CAP) is None
    assert "at most 16 strings" in causal_lm.stop_strings(["s%d" % i for i in range(P.MAX_STOP_STRINGS + 1)])
    assert "at most 16 strings" in causal_lm.stop_strings(["w" * (P.MAX_STOP_CHARS + 1)])


def naive_held_tail(text, stops):
    """The rule by its definition: the longest end of `text` that begins a stop string."""
    return max((n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])),
               default=0)


def test_the_held_tail_is_the_longest_end_that_begins_a_stop_string():
    rng = random.Random(4)
    for _ in range(20000):
        text = "".join(rng.choice("ab ") for _ in range(rng.randint(0, 14)))
        stops = tuple("".join(rng.choice("ab ") for _ in range(rng.randint(1, 9))) for _ in range(rng.randint(0, 4)))
        assert _held_tail(text, stops) == naive_held_tail(text, stops), (text, stops)
    worst = tuple("ab" * (P.MAX_STOP_CHARS // 2) for _ in range(P.MAX_STOP_STRINGS))
    assert _held_tail("a" * 1000, worst) == 1 == naive_held_tail("a" * 1000, worst)


def test_stop_strings_at_the_cap_change_nothing_until_one_comes(runner):
    plain = run_alone(runner, "c d e f", max_new_tokens=10)
    assert run_alone(runner, "c d e f", max_new_tokens=10, stop=AT_THE_CAP) == plain
    word = plain.split()[2]
    cut = run_alone(runner, "c d e f", max_new_tokens=10, stop=[*AT_THE_CAP[:-1], word])
    assert word not in cut and plain.startswith(cut)


# -- end to end: a real daemon over ZeroMQ -----------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory, model_dir, runner):
    tmp = tmp_path_factory.mktemp("genfaults")
    daemon = start_tiny_generative(tmp, model_dir, kv_budget_tokens=2000)
    yield daemon
    daemon.stop()


@pytest.fixture
def sock(served):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(served.endpoint)
    yield s
    s.close()


def send(sock, rid, text, **extra):
    sock.send(msgspec.msgpack.encode({"id": rid, "model": "tiny", "text": text, **extra}))


def frame(sock):
    assert sock.poll(60_000), "no frame within 60 s"
    return msgspec.msgpack.decode(sock.recv_multipart()[0])


def frames_until_final(sock, ids, chunks=None):
    """Frames for `ids` until each has its final one: (chunks by id, finals by id)."""
    chunks, finals = chunks or {i: [] for i in ids}, {}
    while len(finals) < len(ids):
        got = frame(sock)
        assert got["id"] not in finals, "a frame after the final one"
        if "ok" in got:
            finals[got["id"]] = got
        else:
            chunks[got["id"]].append(got)
    return chunks, finals


@pytest.mark.parametrize("temperature", [1e-308, 5e-324])
def test_a_tiny_temperature_beside_three_streams_fails_none_of_them(served, sock, runner, temperature):
    """The fuzzer's case: three streams generating, then one request at a tiny temperature. All four
    used to end model_error ("failed a generation step"); now each ends well with its greedy text."""
    text = run_alone(runner, "w1 w2", max_new_tokens=200, stop=["<never>"])
    innocent = {rid: text for rid in range(3)}
    for rid in innocent:
        send(sock, rid, "w1 w2", stream=True, generate={"max_new_tokens": 200, "stop": ["<never>"]})
    chunks = {rid: [] for rid in (*innocent, "tiny")}
    while not all(chunks[rid] for rid in innocent):   # each is generating
        got = frame(sock)
        assert "ok" not in got, got
        chunks[got["id"]].append(got)
    send(sock, "tiny", "c d e f", stream=True, generate={"temperature": temperature, "max_new_tokens": 8})
    chunks, finals = frames_until_final(sock, list(chunks), chunks)
    assert all(final["ok"] for final in finals.values()), finals
    for rid, text in innocent.items():
        assert "".join(c["text"] for c in chunks[rid]) == text
    assert "".join(c["text"] for c in chunks["tiny"]) == run_alone(runner, "c d e f", max_new_tokens=8)
    assert "failed a generation step" not in served.log.read_text(errors="replace")


def test_too_many_or_too_long_stop_strings_are_bad_request_naming_generate_stop(served, sock):
    send(sock, 1, "w1 w2", generate={"stop": ["zq%017d" % i for i in range(P.MAX_STOP_STRINGS + 1)]})
    send(sock, 2, "w1 w2", generate={"stop": ["w" * (P.MAX_STOP_CHARS + 1)]})
    send(sock, 3, "w1 w2", stream=True, generate={"stop": AT_THE_CAP, "max_new_tokens": 6})
    _, finals = frames_until_final(sock, [1, 2, 3])
    for rid, rule in ((1, f"at most {P.MAX_STOP_STRINGS} strings"), (2, f"at most {P.MAX_STOP_CHARS} characters")):
        assert not finals[rid]["ok"] and finals[rid]["error"]["code"] == P.BAD_REQUEST
        assert finals[rid]["error"]["message"].startswith("generate.stop ") and rule in finals[rid]["error"]["message"]
    assert finals[3]["ok"], finals[3]
