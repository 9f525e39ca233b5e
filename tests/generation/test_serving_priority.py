"""The worker's loop orders jobs by their channel's priority as the config means it (higher
first), though the generation scheduler counts classes lower first: a GenerateJob carries the
config's priority, and the loop turns it around."""

from __future__ import annotations

from dynbatchd import protocol as P
from test_serving_loop import make


def test_the_higher_priority_channel_is_served_first_when_only_one_fits():
    runner, loop = make(kv_budget_tokens=10)          # room for one job's prompt + max_new_tokens at a time
    loop.take(P.GenerateJob(1, "m", "a b c", {"max_new_tokens": 4}, channel="bulk", priority=0))
    loop.take(P.GenerateJob(2, "m", "a b c", {"max_new_tokens": 4}, channel="realtime", priority=2))
    first = [m for m in loop.step() if isinstance(m, P.GenTokens)]
    assert [j for m in first for j, _, _ in m.items] == [2]
    assert loop.scheduler.channels["realtime"].priority < loop.scheduler.channels["bulk"].priority
