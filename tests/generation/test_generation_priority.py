"""The worker's generation loop takes its channels' settings from each job: preemption follows the
config's `priority` (higher first, as everywhere in the daemon and in `dynbatchctl simulate`): a
higher-priority arrival takes a lower one's KV, never the reverse; and a reload's new targets apply
from the next job. Fake runner and clock of test_serving_loop (no torch)."""

from __future__ import annotations

from dynbatchd import protocol as P
from dynbatchd.generation.serving import NO_TARGET_MS
from test_serving_loop import make, run_all


def ends(messages):
    return [m.job for m in messages if isinstance(m, P.GenEnd)]


def run(first_priority: int, second_priority: int):
    """Job 1 running alone with room for one, then job 2 arrives: (end order, preemptions)."""
    runner, loop = make(kv_budget_tokens=10)          # one job's worst case (3 + 5 tokens) at a time
    loop.take(P.GenerateJob(1, "m", "a b c", {"max_new_tokens": 5}, channel="one", priority=first_priority))
    assert not ends(loop.step()) and "1" in runner.sequences    # job 1 prefilled and running
    loop.take(P.GenerateJob(2, "m", "a b c", {"max_new_tokens": 5}, channel="two", priority=second_priority))
    return ends(run_all(loop)), loop.scheduler.preemptions


def test_a_higher_priority_arrival_preempts_a_lower_one():
    assert run(-1, 3) == ([2, 1], 1)        # job 1 recomputed after job 2


def test_a_lower_priority_arrival_waits_for_the_running_one():
    assert run(3, -1) == ([1, 2], 0)


def test_a_reloaded_channel_target_reaches_the_loop_with_the_next_job():
    """A reload that changes ttft_ms / tpot_ms (not priority) reaches the worker with the next job."""
    runner, loop = make()
    loop.take(P.GenerateJob(1, "m", "a b c", channel="chat", priority=1, ttft_ms=500.0, tpot_ms=80.0))
    loop.take(P.GenerateJob(2, "m", "a b c", channel="chat", priority=1, ttft_ms=200.0))
    targets = loop.scheduler.channels["chat"]
    assert (targets.priority, targets.ttft_ms, targets.tpot_ms) == (-1, 200.0, NO_TARGET_MS)
