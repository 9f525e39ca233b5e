"""The worker's generation loop (dynbatchd.generation.serving) with a fake runner and a fake clock:
no torch, no sockets. Each prompt word is a token; a sequence generates "t0 t1 ..."."""

from __future__ import annotations

from dataclasses import dataclass, field

from dynbatchd import protocol as P
from dynbatchd.devices.causal_lm import TokenEvent
from dynbatchd.generation.serving import GenerationLoop, scheduler_for


@dataclass
class FakeSeq:
    prompt_ids: list[int]
    max_new_tokens: int
    generated: list[int] = field(default_factory=list)
    text: str = ""
    kv: bool = False


class FakeRunner:
    def __init__(self):
        self.sequences: dict[str, FakeSeq] = {}
        self.steps: list[tuple[tuple[str, ...], tuple[str, ...]]] = []

    def add(self, seq_id, prompt, *, max_new_tokens=None, stop=None, temperature=None, top_k=None, seed=None):
        if not prompt.split():
            raise ValueError("empty prompt")
        seq = self.sequences[seq_id] = FakeSeq(list(range(len(prompt.split()))), max_new_tokens or 4)
        return seq

    def remove(self, seq_id):
        return self.sequences.pop(seq_id, None)

    def preempt(self, seq_id):
        self.sequences[seq_id].kv = False

    def _token(self, seq_id):
        seq = self.sequences[seq_id]
        seq.kv = True
        seq.generated.append(len(seq.generated))
        piece = f"{'' if len(seq.generated) == 1 else ' '}t{len(seq.generated) - 1}"
        seq.text += piece
        return TokenEvent(seq_id, seq.generated[-1], piece,
                          "length" if len(seq.generated) >= seq.max_new_tokens else None)

    def prefill(self, ids):
        return [self._token(i) for i in ids]

    def decode_step(self, ids):
        self.steps.append((tuple(ids), ()))
        return [self._token(i) for i in ids]


class Clock:
    def __init__(self):
        self.ms = 0.0

    def __call__(self):
        self.ms += 1.0          # every reading is one millisecond later
        return self.ms


def make(**options):
    runner = FakeRunner()
    return runner, GenerationLoop(runner, scheduler_for({"kv_budget_tokens": 100, **options}), Clock())


def job(n, prompt="a b c", **kw):
    return P.GenerateJob(n, "m", prompt, channel="standard", **kw)


def run_all(loop):
    messages = []
    while loop.busy:
        messages += loop.step()
    return messages


def test_jobs_join_at_token_boundaries_and_each_ends_once_with_its_text():
    runner, loop = make()
    loop.take(job(1, options={"max_new_tokens": 3}))
    first = loop.step()                     # job 1 prefills alone
    loop.take(job(2, options={"max_new_tokens": 2}))
    rest = run_all(loop)
    tokens = [item for m in first + rest if isinstance(m, P.GenTokens) for item in m.items]
    ends = {m.job: m for m in first + rest if isinstance(m, P.GenEnd)}
    assert "".join(t for j, t, _ in tokens if j == 1) == "t0 t1 t2"
    assert "".join(t for j, t, _ in tokens if j == 2) == "t0 t1"
    assert ends[1].reason == ends[2].reason == "length"
    assert (ends[1].output_tokens, ends[1].prompt_tokens, ends[1].text) == (3, 3, "t0 t1 t2")
    assert ends[2].kv_in_use_bytes == 0 and loop.scheduler.ledger.in_use_bytes == 0
    assert any(set(ids) == {"1", "2"} for ids, _ in runner.steps)   # they shared a decode step
    assert runner.sequences == {}


def test_cancel_frees_the_kv_at_once_and_ends_the_job_cancelled():
    runner, loop = make()
    loop.take(job(1, options={"max_new_tokens": 50}))
    loop.step()
    assert loop.scheduler.ledger.in_use_bytes == 3 + 50
    end = loop.cancel(1)
    assert end.reason == P.CANCELLED and end.output_tokens == 1 and end.kv_in_use_bytes == 0
    assert loop.cancel(1) is None          # already ended: nothing twice
    assert not loop.busy and runner.sequences == {}


def test_a_deadline_ends_a_running_job_mid_generation_and_frees_its_kv():
    _, loop = make()
    loop.take(job(1, options={"max_new_tokens": 50}, deadline_ms=10.0))
    messages = run_all(loop)
    ends = [m for m in messages if isinstance(m, P.GenEnd)]
    assert [e.reason for e in ends] == ["deadline_exceeded"]
    assert 0 < ends[0].output_tokens < 50 and loop.scheduler.ledger.in_use_bytes == 0


def test_a_job_that_can_never_fit_and_an_empty_prompt_are_bad_requests():
    _, loop = make()
    loop.take(job(1, options={"max_new_tokens": 98}))     # 3 + 98 > 100
    loop.take(job(2, prompt="   "))
    ends = {m.job: m for m in run_all(loop) if isinstance(m, P.GenEnd)}
    assert ends[1].reason == ends[2].reason == "bad_request"
    assert "KV budget of 100 tokens" in ends[1].message


def test_static_mode_runs_one_batch_to_its_longest_member():
    runner, loop = make(mode="static")
    loop.take(job(1, options={"max_new_tokens": 4}))
    loop.step()
    loop.take(job(2, options={"max_new_tokens": 1}))   # arrives mid-batch: waits for the batch to end
    run_all(loop)
    assert all("2" not in ids for ids, _ in runner.steps[:2])


def test_a_tail_that_could_become_a_stop_string_is_held_back():
    from dynbatchd.devices.causal_lm import _held_tail

    assert _held_tail("w1 w2 EN", ("END",)) == 2          # "EN" may become "END": not sent yet
    assert _held_tail("w1 w2 E", ("END", "w9")) == 1
    assert _held_tail("w1 w2", ("END",)) == 0
    assert _held_tail("abc", ()) == 0


def test_the_metrics_page_shows_generation_once_there_is_some():
    from dynbatchd import metrics
    from dynbatchd.generating import Generations

    from test_metrics import status

    page = lambda gen: metrics.render({**status(), "generation": gen}, gpu={})  # noqa: E731
    gens = Generations(daemon=None)
    assert "dynbatchd_generated_tokens_total" not in page(gens.snapshot())
    gens.generated_tokens["chat"] = 12
    gens.ended["length"] = 2
    from dynbatchd.telemetry import Histogram
    gens.ttft["chat"] = Histogram()
    gens.ttft["chat"].record(40_000)
    text = page(gens.snapshot())
    assert 'dynbatchd_generated_tokens_total{channel="chat"} 12' in text
    assert 'dynbatchd_generations_total{reason="length"} 2' in text
    assert 'dynbatchd_time_to_first_token_seconds_count{channel="chat"} 1' in text
    assert "# TYPE dynbatchd_time_to_first_token_seconds histogram" in text   # per channel, any window
    assert 'dynbatchd_time_to_first_token_seconds_bucket{channel="chat",le="0.032768"} 0' in text
    assert 'dynbatchd_time_to_first_token_seconds_bucket{channel="chat",le="0.065536"} 1' in text
    assert 'dynbatchd_time_to_first_token_seconds_bucket{channel="chat",le="+Inf"} 1' in text
    assert "dynbatchd_kv_in_use_tokens 0" in text
    import shutil
    import subprocess

    if promtool := shutil.which("promtool"):   # (the Debian package `prometheus`; .ci/run installs it)
        gens.tpot["chat"] = Histogram()
        gens.tpot["chat"].record(900)
        check = subprocess.run([promtool, "check", "metrics"], input=page(gens.snapshot()), capture_output=True,
                               text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr


def test_the_tpot_guard_learns_the_step_cost_from_the_loops_own_steps():
    from dynbatchd.generation.serving import StepCost, loop_for

    cost = StepCost(weight=1.0)
    assert cost.estimate_ms(100, 4) == 0.0           # nothing seen: the guard holds nothing back
    cost.observe(0, 4, 10.0)                          # a decode-only step: 10 ms
    cost.observe(50, 4, 60.0)                         # 50 prefill tokens beside it: 1 ms a token
    assert cost.estimate_ms(100, 4) == 110.0
    runner = FakeRunner()
    runner.options = {"tpot_guard": True, "kv_budget_tokens": 100}
    loop = loop_for(runner, Clock())
    assert loop.cost is not None and loop.scheduler.step_cost_ms == loop.cost.estimate_ms
    loop.take(job(1, options={"max_new_tokens": 3}))
    run_all(loop)
    assert loop.cost.decode_ms is not None          # fed by the steps it ran
    runner.options = {}
    assert loop_for(runner, Clock()).scheduler.step_cost_ms is None


class FakeSocket:
    def __init__(self):
        self.sent = []

    def send(self, raw):
        self.sent.append(P.worker_decoder.decode(raw))


def test_the_worker_steps_its_loops_and_ends_every_job_of_a_failing_model():
    from dynbatchd.devices.worker import Generating

    sock = FakeSocket()
    generating = Generating(sock)
    runner = FakeRunner()
    runner.options = {"kv_budget_tokens": 100}
    runners = {"m": runner, "emb": object()}
    generating.handle(P.GenerateJob(1, "emb", "a b"), runners)     # not generative
    generating.handle(P.GenerateJob(2, "gone", "a b"), runners)    # not loaded
    assert [(m.job, m.reason) for m in sock.sent] == [(1, "error"), (2, "error")]
    generating.handle(P.GenerateJob(3, "m", "a b", options={"max_new_tokens": 2}), runners)
    while generating.busy:
        generating.step()
    assert sock.sent[-1].job == 3 and sock.sent[-1].reason == "length"
    generating.handle(P.GenerateJob(4, "m", "a b", options={"max_new_tokens": 9}), runners)
    generating.step()
    runner.decode_step = lambda ids: 1 / 0            # the model fails mid-generation
    generating.step()
    assert (sock.sent[-1].job, sock.sent[-1].reason) == (4, "error") and "ZeroDivisionError" in sock.sent[-1].message
    assert not generating.busy and runner.sequences == {}
