"""Live and simulated generation make the same decisions (issue 29): the worker's step loop
(`dynbatchd.generation.serving.GenerationLoop`, what the daemon runs beside the model) and the
simulator `dynbatchctl simulate` drives (`dynbatchd.generation.simulation.simulate_generation`)
share one scheduler, so given the same arrivals and a device that takes the latency model's time
per step they must produce the same schedule: every request's reason, tokens, preemptions, time
to first token and total time. The device here is a fake runner that advances a fake clock by
`GenerationLatency`'s cost of each step (no torch); the workload is the mixed one, two channels of
different priority and a KV budget small enough to make requests wait and be preempted."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from dynbatchd import protocol as P
from dynbatchd.devices.causal_lm import TokenEvent
from dynbatchd.generation.batching import ChannelTargets, GenRequest
from dynbatchd.generation.serving import GenerationLoop, scheduler_for
from dynbatchd.generation.simulation import GenerationLatency, mixed_workload, simulate_generation

# costs and arrival times in binary fractions of a millisecond, so both sides' sums are exact and a
# step ends at the same float whichever order its terms are added in
LATENCY = GenerationLatency(step_ms=12.0, per_seq_ms=0.125, per_kv_token_ms=0.0, prefill_ms_per_token=0.0625)
OPTIONS = {"kv_budget_tokens": 6000, "max_batch_sequences": 16, "max_prefill_tokens": 2048}
# config priorities (higher first) and the scheduler's (lower first) for the same two channels
CHANNELS = {"realtime": (2, 1000.0, 100.0), "standard": (0, 3000.0, 150.0)}


class Clock:
    def __init__(self):
        self.ms = 0.0

    def __call__(self) -> float:
        return self.ms


@dataclass
class Seq:
    prompt_ids: list[int]
    max_new_tokens: int
    generated: list[int] = field(default_factory=list)
    text: str = ""


class CostedRunner:
    """A causal-lm runner's step interface whose steps take the latency model's time on `clock`."""

    def __init__(self, clock: Clock):
        self.clock, self.sequences = clock, {}

    def add(self, seq_id, prompt, *, max_new_tokens=None, **_):
        self.sequences[seq_id] = Seq(list(range(len(prompt.split()))), max_new_tokens)
        return self.sequences[seq_id]

    def remove(self, seq_id):
        return self.sequences.pop(seq_id, None)

    def preempt(self, seq_id):
        pass                                    # the KV goes; the tokens stay, and are recomputed

    def _token(self, seq_id):
        seq = self.sequences[seq_id]
        seq.generated.append(0)
        seq.text += "t "
        return TokenEvent(seq_id, 0, "t ", "length" if len(seq.generated) >= seq.max_new_tokens else None)

    def prefill(self, ids):
        context = sum(len(self.sequences[i].prompt_ids) + len(self.sequences[i].generated) for i in ids)
        self.clock.ms += LATENCY.prefill_ms_per_token * context
        return [self._token(i) for i in ids]

    def decode_step(self, ids):                 # called once every step, after prefill
        self.clock.ms += LATENCY.step_ms + LATENCY.per_seq_ms * len(ids)
        return [self._token(i) for i in ids]


def live(requests: list[GenRequest]) -> tuple[dict[str, P.GenEnd], dict[str, float]]:
    """The worker loop over `requests`, each taken at the first step boundary at or after its
    arrival (as the simulator submits it): each job's end, and when it was taken."""
    clock = Clock()
    loop = GenerationLoop(CostedRunner(clock), scheduler_for(OPTIONS), clock)
    pending, ends, taken = list(requests), {}, {}
    while pending or loop.busy:
        while pending and pending[0].arrival_ms <= clock.ms:
            r = pending.pop(0)
            priority, ttft, tpot = CHANNELS[r.channel]
            taken[r.id] = clock.ms
            loop.take(P.GenerateJob(int(r.id[1:]), "lm", " ".join(["w"] * r.prompt_tokens),
                                    {"max_new_tokens": r.max_new_tokens}, r.channel, priority, ttft, tpot))
        if not loop.busy:
            clock.ms = pending[0].arrival_ms
            continue
        for message in loop.step():
            if isinstance(message, P.GenEnd):
                ends[f"r{message.job}"] = message
    return ends, taken


@pytest.mark.parametrize("rate", [4.0, 12.0])
def test_the_worker_loop_and_the_simulator_make_the_same_schedule(rate):
    drawn = mixed_workload(120, rate_per_s=rate, seed=3, channels=tuple(CHANNELS),
                           prompt_range=(16, 1024), output_range=(16, 256))
    requests = [GenRequest(r.id, r.channel, r.prompt_tokens, r.max_new_tokens, round(r.arrival_ms * 64) / 64)
                for r in drawn]
    ends, taken = live(requests)
    # the simulator gets the arrivals as the loop saw them: at the step boundary it took each
    seen = [GenRequest(r.id, r.channel, r.prompt_tokens, r.max_new_tokens, taken[r.id]) for r in requests]
    targets = {name: ChannelTargets(name, -p, ttft, tpot) for name, (p, ttft, tpot) in CHANNELS.items()}
    report = simulate_generation(seen, targets, mode="continuous", kv_budget_tokens=OPTIONS["kv_budget_tokens"],
                                 latency=LATENCY, max_batch=OPTIONS["max_batch_sequences"],
                                 max_prefill_tokens=OPTIONS["max_prefill_tokens"])
    simulated = {f.id: f for f in report.finished}
    assert set(simulated) == set(ends) == {r.id for r in requests}
    for rid, f in simulated.items():
        e = ends[rid]
        assert (e.reason, e.output_tokens, e.preemptions) == (f.reason, f.output_tokens, f.preemptions), rid
        assert e.ttft_us == int(f.ttft_ms * 1000) and e.total_us == int((f.end_ms - f.arrival_ms) * 1000), rid
    assert report.kv["kv_over_budget"] == 0
    if rate == 12.0:    # the case is not trivial: requests waited for KV and some were preempted
        assert report.kv["kv_refused"] > 0 and report.preemptions > 0
