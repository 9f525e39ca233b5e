"""The generative simulator refuses what the daemon refuses: a channel holds at most its
`queue_limit` generate jobs in flight (waiting or generating), and one more is answered overloaded
on arrival (`dynbatchd.generating.Generations.start`). Without it `dynbatchctl simulate` and
`capacity` showed every job served where the daemon refuses some. Fake clocks only."""

from __future__ import annotations

import json
import math
import types
from dataclasses import dataclass

import pytest
from typer.testing import CliRunner

from dynbatchd import protocol as P
from dynbatchd.cli.dynbatchctl import app
from dynbatchd.generation.batching import ChannelTargets, GenRequest
from dynbatchd.generation.replay import TimedJob, replay
from dynbatchd.generation.serving import GenerationLoop, scheduler_for
from dynbatchd.generation.simulation import GenerationLatency, simulate_generation
from dynbatchd.simulate.generative import queue_limits

STEP_MS = 10.0
LATENCY = GenerationLatency(step_ms=STEP_MS, per_seq_ms=0.0, per_kv_token_ms=0.0, prefill_ms_per_token=0.0)
TARGETS = {"s": ChannelTargets("s", 0, 1e9, 1e9), "other": ChannelTargets("other", 1, 1e9, 1e9)}
LIMIT, BURST, TOKENS, PROMPT = 4, 10, 5, 8
OPTIONS = {"kv_budget_tokens": 1 << 20, "max_batch_sequences": 64, "max_prefill_tokens": 1 << 16}


def burst(n: int, at_ms: float, tag: str, channel: str = "s") -> list[GenRequest]:
    return [GenRequest(f"{tag}{i}", channel, PROMPT, TOKENS, at_ms) for i in range(n)]


def simulated(requests: list[GenRequest], limits, max_batch: int = 64):
    return simulate_generation(requests, TARGETS, mode="continuous", kv_budget_tokens=OPTIONS["kv_budget_tokens"],
                               latency=LATENCY, max_batch=max_batch, queue_limits=limits)


def refused(report) -> list[str]:
    return [f.id for f in report.finished if f.reason == P.OVERLOADED]


@pytest.mark.parametrize("max_batch", [1, LIMIT, 64])
def test_a_burst_past_the_limit_is_refused_at_once_however_many_the_device_runs(max_batch):
    """The daemon counts the jobs generating as well as those waiting, so what the device takes at
    once changes nothing: the first LIMIT of a burst are held, the rest refused on arrival."""
    report = simulated(burst(BURST, 0.0, "a"), {"s": LIMIT}, max_batch)
    assert refused(report) == [f"a{i}" for i in range(LIMIT, BURST)]
    assert report.overloaded == report.summary()["overloaded"] == BURST - LIMIT
    for f in report.finished:
        if f.reason == P.OVERLOADED:
            assert (f.output_tokens, f.first_token_ms, f.end_ms) == (0, None, f.arrival_ms)
            assert not report.met(f)   # a refusal is a miss, as in the batch simulator
        else:
            assert f.reason == "length" and f.output_tokens == TOKENS


def test_a_place_frees_when_its_job_ends_not_before():
    """Bursts while the held jobs generate (one in their last step: the daemon hears of their end
    after it) are refused whole; a burst at their end finds the channel empty again. Another
    channel has its own count."""
    first = simulated(burst(BURST, 0.0, "a"), {"s": LIMIT})
    end = max(f.end_ms for f in first.finished if f.reason == "length")
    requests = (burst(BURST, 0.0, "a") + burst(BURST, end / 2, "b") + burst(BURST, end - STEP_MS / 2, "c")
                + burst(BURST, end, "d") + burst(BURST, end / 2, "o", channel="other"))
    report = simulated(requests, {"s": LIMIT})
    got = set(refused(report))
    assert got == ({f"a{i}" for i in range(LIMIT, BURST)} | {f"b{i}" for i in range(BURST)}
                   | {f"c{i}" for i in range(BURST)} | {f"d{i}" for i in range(LIMIT, BURST)})
    assert len(report.finished) == len(requests)


@pytest.mark.parametrize("limits", [None, {}, {"s": BURST}, {"s": BURST, "other": None}])
def test_a_limit_the_burst_does_not_pass_refuses_none_and_changes_nothing(limits):
    """A burst of exactly the limit is held whole (reached, not passed); a channel without a limit has none."""
    requests = burst(BURST, 0.0, "a") + burst(3 * BURST, STEP_MS / 2, "o", channel="other")
    report = simulated(requests, limits)
    assert report.overloaded == 0 and report.finished == simulated(requests, None).finished
    assert len(report.finished) == len(requests)


@dataclass
class Event:
    seq_id: str
    text: str
    finished: str | None = None
    error: str = ""


class Runner:
    """A causal-lm runner's step interface on a fake clock: each step takes the latency model's step_ms."""

    def __init__(self, clock: list[float]):
        self.clock, self.left, self.options = clock, {}, {}

    def add(self, seq_id, prompt, *, max_new_tokens=None, **_):
        self.left[seq_id] = max_new_tokens
        return types.SimpleNamespace(prompt_ids=prompt.split(), max_new_tokens=max_new_tokens, generated=[], text="")

    def remove(self, seq_id):
        self.left.pop(seq_id, None)

    def preempt(self, seq_id):
        pass

    def _token(self, seq_id):
        self.left[seq_id] -= 1
        return Event(seq_id, "t ", None if self.left[seq_id] else "length")

    def prefill(self, ids):
        return [self._token(i) for i in ids]

    def decode_step(self, ids):                 # once a step, after prefill: the step's time
        self.clock[0] += STEP_MS
        return [self._token(i) for i in ids]


def test_the_worker_loop_replay_refuses_the_jobs_the_simulator_refuses():
    """`replay` (the worker's own loop, as the CPU benchmark runs it) with the same limits and the
    same bursts refuses the same jobs as the simulator."""
    first = simulated(burst(BURST, 0.0, "a"), {"s": LIMIT})
    end = max(f.end_ms for f in first.finished if f.reason == "length")
    requests = (burst(BURST, 0.0, "a") + burst(BURST, end / 2, "b") + burst(BURST, end - STEP_MS / 2, "c")
                + burst(BURST, end, "d"))
    clock = [0.0]
    jobs = [TimedJob(r.arrival_ms, P.GenerateJob(n, "lm", " ".join(["w"] * r.prompt_tokens),
                                                 {"max_new_tokens": r.max_new_tokens}, r.channel, 0, 1e9, 1e9))
            for n, r in enumerate(requests)]
    loop = GenerationLoop(Runner(clock), scheduler_for(OPTIONS), lambda: clock[0])
    run = replay(loop, jobs, lambda: clock[0], lambda ms: clock.__setitem__(0, clock[0] + ms), {"s": LIMIT})
    assert len(run.ends) == len(jobs)
    live = sorted(requests[e.job].id for e in run.ends if e.reason == P.OVERLOADED)
    assert live == sorted(refused(simulated(requests, {"s": LIMIT}))) and run.overloaded == len(live) > 0


@pytest.mark.parametrize("limit,devices", [(1, 1), (4, 1), (4, 3), (1024, 14), (3, 8)])
def test_each_simulated_device_holds_its_share_of_the_daemons_limit(limit, devices):
    """The daemon's count spans its devices; one device of `devices` gets limit / devices, rounded up."""
    cfg = types.SimpleNamespace(channels={"s": types.SimpleNamespace(queue_limit=limit)})
    share = queue_limits(cfg, devices)["s"]
    assert share == math.ceil(limit / devices) and share >= 1


def config(tmp_path, queue_limit: int):
    (tmp_path / "lm").mkdir(exist_ok=True)
    (tmp_path / "lm" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    path = tmp_path / "gen.toml"
    path.write_text(f"""
[daemon]
control = "ipc://{tmp_path}/ctl"
[models.lm]
runner = "causal-lm"
options = {{ path = "{tmp_path / 'lm'}", kv_budget_tokens = 200000, simulated = {{ step_ms = 12.0 }} }}
[routing]
default = "standard"
[channels.standard]
max_batch = 8
window_ms = 0
deadline_ms = 60000
queue_limit = {queue_limit}
ttft_ms = 3000
tpot_ms = 150
""")
    return str(path)


@pytest.mark.parametrize("queue_limit", [1, 1 << 20])
def test_simulate_prints_and_counts_the_refusals(tmp_path, queue_limit):
    args = ["simulate", "--config", config(tmp_path, queue_limit), "--rate", "50", "--duration", "2",
            "--mode", "continuous"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)["modes"]["continuous"]
    assert data["overloaded"] == data["channels"]["standard"]["overloaded"]
    assert (data["overloaded"] > 0) == (queue_limit == 1)   # 100 requests of 16+ tokens overlap
    text = CliRunner().invoke(app, [*args, "--wide"]).output
    assert "overloaded" in text and f"{data['overloaded']} refused overloaded" in text and "SIMULATED" in text


def test_capacity_shows_the_share_refused_per_pool_size(tmp_path):
    result = CliRunner().invoke(app, ["capacity", "--config", config(tmp_path, 2), "--requests-per-day", "200k",
                                      "--duration", "5", "--json"])
    assert result.exit_code == 0, result.output
    trials = json.loads(result.output)["trials"]
    assert trials and all(0.0 <= t["overloaded_fraction"] <= 1.0 for t in trials)
    assert any(t["overloaded"] > 0 for t in trials)
