"""A live canary inside the engine, against a fake clock: the split is exact, each request is
answered once (a shadow copy never), the verdict ends the split, and the twin channel goes once
it is empty."""

from __future__ import annotations

import pytest

from dynbatchd import protocol as P
from dynbatchd.config import ChannelSettings
from dynbatchd.engine import OK, Engine, Job, Outcome, VerdictEvent
from dynbatchd.scheduler import build_channels
from dynbatchd.tuning.canary import PROMOTE, ROLLBACK, Canary

MS = 1_000_000
TWIN = "c~canary"


def engine() -> Engine:
    e = Engine(build_channels({"c": ChannelSettings(max_batch=4, window_ms=0, deadline_ms=100)}), ["d0", "d1"])
    e.device_up(0)
    e.device_up(1)
    return e


def twin(max_batch: int = 8) -> object:
    return build_channels({TWIN: ChannelSettings(max_batch=max_batch, window_ms=0, deadline_ms=100)})[TWIN]


def serve(e: Engine, n: int, now: int, compute_ns=lambda batch: MS) -> tuple[dict[int, str], list[str]]:
    """Submit n requests at `now`, run every batch at once; (answers by request, channel of each batch)."""
    answers: dict[int, str] = {}

    def take(found) -> None:
        for a in found:
            assert a.payload not in answers, f"request {a.payload} answered twice"
            answers[a.payload] = a.code

    for i in range(n):
        answer = e.submit(Job("m", "c", 1, 100, i), now)
        if answer is not None:
            take([answer])
    channels = []
    while True:
        dispatches, found = e.step(now)
        take(found)
        if not dispatches:
            return answers, channels
        for d in dispatches:
            channels.append(d.batch.channel)
            take(e.completed(d.device, d.batch.id, Outcome(compute_ns(d.batch), [0] * len(d.batch.items)),
                             now + compute_ns(d.batch)))


def test_the_twin_takes_exactly_its_share_and_every_request_is_answered_once():
    e = engine()
    canary = Canary(0.25, 10**12, 0, min_answered=1)
    e.start_split("c", twin(), canary)
    answers, _ = serve(e, 400, 0)
    assert len(answers) == 400 and set(answers.values()) == {OK}
    assert (canary.candidate.answered, canary.incumbent.answered) == (100, 300)
    assert e.channels[TWIN].stats.completed == 100


def test_shadow_copies_run_under_the_candidate_and_are_never_answered():
    e = engine()
    canary = Canary(0.5, 10**12, 0, min_answered=1)
    e.start_split("c", twin(), canary, shadow=True)
    answers, channels = serve(e, 100, 0)
    assert len(answers) == 100 and set(answers.values()) == {OK}   # only the originals, once each
    assert canary.incumbent.answered == 100 and canary.candidate.answered == 50
    assert channels.count(TWIN) >= 1 and e.channels["c"].stats.completed == 100


def test_a_candidate_that_misses_is_rolled_back_early_and_its_twin_removed_once_empty():
    e = engine()
    canary = Canary(0.5, 10**12, 0, abort_misses=5)
    e.start_split("c", twin(), canary)
    # the twin's batches take 200 ms against a 100 ms deadline; the incumbent's 1 ms
    answers, _ = serve(e, 40, 0, compute_ns=lambda b: 200 * MS if b.channel == TWIN else MS)
    assert len(answers) == 40
    ended = [event.split for event in e.take_events() if isinstance(event, VerdictEvent)]
    assert ended and ended[0].verdict.action == ROLLBACK and "missed" in ended[0].verdict.reason
    assert "c" not in e.splits
    before = canary.candidate.answered
    answers, channels = serve(e, 20, 10**9)   # after the verdict everything stays on the incumbent
    assert set(channels) == {"c"} and canary.candidate.answered == before
    assert TWIN not in e.channels and TWIN not in e.scheduler.channels


def test_the_time_running_out_ends_the_split_without_traffic():
    e = engine()
    canary = Canary(0.5, 50 * MS, 0, min_answered=1)
    split = e.start_split("c", twin(), canary)
    serve(e, 20, 0)
    e.step(10 * MS)
    assert "c" in e.splits
    e.step(60 * MS)
    assert "c" not in e.splits and split.verdict is not None
    assert split.verdict.action in (PROMOTE, ROLLBACK)
    assert TWIN not in e.channels


def test_one_canary_at_a_time_and_the_twin_learns_from_the_incumbents_cost():
    e = engine()
    serve(e, 64, 0)   # the incumbent learns its cost
    samples = e.channels["c"].cost.samples
    assert samples > 0
    t = twin()
    e.start_split("c", t, Canary(0.5, 10**12, 0))
    assert t.cost.samples == samples and t.cost is not e.channels["c"].cost
    with pytest.raises(ValueError, match="already running"):
        e.start_split("c", twin(), Canary(0.5, 10**12, 0))


def test_an_overloaded_twin_answers_overloaded_and_counts_a_miss():
    e = Engine(build_channels({"c": ChannelSettings(max_batch=4, window_ms=50, deadline_ms=100)}), ["d0"])
    e.device_up(0)
    small = build_channels({TWIN: ChannelSettings(max_batch=4, window_ms=50, deadline_ms=100, queue_limit=1)})[TWIN]
    canary = Canary(0.5, 10**12, 0, abort_misses=1000)
    e.start_split("c", small, canary)
    codes = [e.submit(Job("m", "c", 1, 100, i), 0) for i in range(6)]
    refused = [a for a in codes if a is not None]
    assert refused and all(a.code == P.OVERLOADED for a in refused)
    assert canary.candidate.answered == len(refused) and canary.candidate.on_time == 0
