"""`RunningQuantile`: a request-size quantile kept in O(1), settling near the true one."""

from __future__ import annotations

import random

from dynbatchd.scheduler.quantile import RunningQuantile


def test_it_settles_near_the_true_quantile_of_a_skewed_stream():
    rng = random.Random(5)
    sizes = [int(rng.lognormvariate(7, 1.2)) for _ in range(20_000)]
    for q in (0.5, 0.9):
        estimate = RunningQuantile(q)
        for x in sizes:
            estimate.add(x)
        tail = sorted(sizes[-5_000:])
        true = tail[int(q * len(tail))]
        assert abs(estimate.value - true) < 0.15 * true, (q, estimate.value, true)


def test_it_starts_at_the_first_value_and_follows_a_shift():
    estimate = RunningQuantile(0.5)
    estimate.add(100)
    assert estimate.seen and 98 <= estimate.value <= 100   # (then a step down: 100 is at or below it)
    for _ in range(2_000):
        estimate.add(10_000)
    assert abs(estimate.value - 10_000) <= 0.02 * 10_000   # (within a step of it)
