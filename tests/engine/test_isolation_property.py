"""Isolation, proven over random schedules: the engine with a fake clock, played by hypothesis.

Each schedule mixes random tenants (and none), channels (two isolated, one
open), token counts, cacheable texts, worker deaths (the running batch retried
alone), out-of-memory outcomes (the batch size shrinks), reloads that change
channel settings (isolated switched on and off, window and max batch),
cancellations and clock steps. After every step three things must hold:

- no batch of an isolated channel mixes tenants, and a request without a
  tenant runs alone (or was refused);
- no batch mixes channels (an isolated channel's request never shares a batch
  with another channel's);
- the result cache never answers a request of an isolated channel.

And every accepted request is answered exactly once.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from dynbatchd import protocol as P
from dynbatchd.cache import ResultCache
from dynbatchd.config import ChannelSettings
from dynbatchd.engine import ANONYMOUS_RULE, OK, Engine, Job, Outcome
from dynbatchd.scheduler import build_channels

MS = 1_000_000
EXAMPLES = 10_000
TENANTS = [None, "hospital-a", "hospital-b", "bank-c"]
TEXTS = ["x", "y", "z"]


def channel_settings(isolated: bool, anonymous: str, max_batch: int = 4, window_ms: float = 2) -> ChannelSettings:
    return ChannelSettings(max_batch=max_batch, window_ms=window_ms, deadline_ms=60_000, queue_limit=64,
                           isolated=isolated, anonymous=anonymous)


CHANNELS = ["med", "fin", "open"]


def decode(n: int) -> tuple:
    """One operation from one integer: a single draw per operation keeps 10,000 schedules cheap
    (hypothesis's own drawing, not the engine, dominated the time), and shrinking n towards 0
    still simplifies the operation."""
    kind, n = n % 6, n // 6
    if kind == 0:
        n, channel = divmod(n, 3)
        n, tenant = divmod(n, len(TENANTS))
        n, text = divmod(n, len(TEXTS) + 1)
        return ("submit", CHANNELS[channel], TENANTS[tenant], n % 3001, (TEXTS + [None])[text])
    if kind == 1:
        return ("step", n % 6)
    if kind == 2:
        return ("finish", n % 2, bool(n // 2 % 2))          # device, out of memory
    if kind == 3:
        return ("die", n % 2)
    if kind == 4:
        return ("cancel", n % 41)
    n, channel = divmod(n, 3)
    n, isolated = divmod(n, 2)
    n, max_batch = divmod(n, 6)
    return ("reload", CHANNELS[channel], bool(isolated), max_batch + 1, [0, 2, 10][n % 3])


op = st.integers(0, 2**40).map(decode)


class Run:
    def __init__(self, anonymous: str):
        self.settings = {"med": channel_settings(True, anonymous), "fin": channel_settings(True, "refuse"),
                         "open": channel_settings(False, anonymous)}
        self.cache = ResultCache(64)
        self.decisions: list[tuple[str, str]] = []
        self.engine = Engine(build_channels(self.settings), ["d0", "d1"], inflight=2, cache=self.cache)
        for d in range(2):
            self.engine.device_up(d)
        self.now = 0
        self.jobs: list[Job] = []
        self.answered: dict[int, str] = {}
        self.running: dict[int, list] = {0: [], 1: []}   # device -> dispatched batches, in order

    def take(self, answers) -> None:
        for a in answers:
            key = id(a.payload)
            assert key not in self.answered, "a request answered twice"
            self.answered[key] = a.code
            job = self.by_payload[key]
            if a.timing is not None and a.timing.device == "cache":
                assert not self.engine.channels[job.channel].settings.isolated, "cache answered an isolated request"

    def check(self, batch) -> None:
        jobs = list(batch.items)   # (each item is its Job)
        assert {j.channel for j in jobs} == {batch.channel}, "a batch mixes channels"
        if self.engine.channels[batch.channel].settings.isolated:
            tenants = {j.tenant for j in jobs}
            assert len(tenants) == 1, f"an isolated batch mixes tenants {tenants}"
            if None in tenants:
                assert len(jobs) == 1, "a request without a tenant shared an isolated batch"

    def step(self) -> None:
        dispatches, answers = self.engine.step(self.now)
        self.take(answers)
        for d in dispatches:
            self.check(d.batch)
            self.running[d.device].append(d.batch)

    def apply(self, operation) -> None:
        kind = operation[0]
        if kind == "submit":
            _, channel, tenant, tokens, text = operation
            payload = object()
            cache_key = ("m", tenant, text) if text is not None else None
            job = Job("m", channel, tokens, 60_000, payload, tenant, cache_key)
            self.jobs.append(job)
            self.by_payload[id(payload)] = job
            answer = self.engine.submit(job, self.now)
            self.decisions += [(event.rule, event.action) for event in self.engine.take_events()]
            if answer is not None:
                self.take([answer])
                if answer.code == P.REFUSED:
                    assert ANONYMOUS_RULE in answer.message and tenant is None
        elif kind == "step":
            self.now += operation[1] * MS
        elif kind == "finish":
            _, device, oom = operation
            if self.running[device]:
                batch = self.running[device].pop(0)
                outcome = (Outcome(MS, oom=True, errors={i: "out of memory" for i in range(len(batch.items))})
                           if oom else Outcome(MS, [f"out {id(i.payload)}" for i in batch.items]))
                self.take(self.engine.completed(device, batch.id, outcome, self.now))
        elif kind == "die":
            device = operation[1]
            self.running[device].clear()
            self.take(self.engine.lost(device, self.now).answers)
            self.engine.device_up(device)
        elif kind == "cancel":
            if operation[1] < len(self.jobs):
                answer = self.engine.cancel(self.jobs[operation[1]], self.now)
                self.take([answer] if answer else [])
        elif kind == "reload":
            _, channel, isolated, max_batch, window_ms = operation
            anonymous = self.settings[channel].anonymous
            new = dict(self.settings)
            new[channel] = channel_settings(isolated, anonymous, max_batch, window_ms)
            rebuilt = build_channels(new)
            self.engine.channels[channel].retune(new[channel], rebuilt[channel])
            self.settings = new
        self.step()

    def finish_everything(self) -> None:
        for _ in range(200):
            self.now += 100 * MS
            self.step()
            for device in (0, 1):
                while self.running[device]:
                    batch = self.running[device].pop(0)
                    self.take(self.engine.completed(device, batch.id, Outcome(MS, ["out"] * len(batch.items)),
                                                    self.now))
            if not self.engine.busy():
                break
        self.step()


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(anonymous=st.sampled_from(["refuse", "alone"]), schedule=st.lists(op, max_size=20))
def test_no_schedule_breaks_isolation(anonymous, schedule):
    run = Run(anonymous)
    run.by_payload = {}
    for operation in schedule:
        run.apply(operation)
    run.finish_everything()
    accepted = [j for j in run.jobs]
    assert all(id(j.payload) in run.answered for j in accepted), "a request was never answered"
    refused = [r for r, a in run.decisions if a == "refused"]
    assert all(r == ANONYMOUS_RULE for r in refused)
    assert sum(code == P.REFUSED for code in run.answered.values()) == len(refused)
    assert all(code in (OK, P.REFUSED, P.CANCELLED, P.MODEL_ERROR, P.DEADLINE_EXCEEDED, P.OVERLOADED)
               for code in run.answered.values()), set(run.answered.values())
