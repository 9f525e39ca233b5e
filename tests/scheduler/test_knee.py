"""Knee detection on synthetic QPS-vs-load curves whose knee is known."""

from __future__ import annotations

import random

from dynbatchd.tuning.knee import find_knee, smooth


def saturating(loads, knee_at, slope=10.0):
    """Linear up to `knee_at`, flat after: the knee is exactly there."""
    return [slope * min(x, knee_at) for x in loads]


def test_a_linear_then_flat_curve_has_its_knee_where_it_flattens():
    loads = [10, 20, 40, 60, 80, 100, 150, 200]
    knee = find_knee(loads, saturating(loads, 60))
    assert knee is not None and knee.load == 60 and knee.drop > 0.9


def test_loads_given_out_of_order_or_repeated_give_the_same_knee():
    loads = [200, 10, 60, 20, 60, 100, 40, 80, 150]
    knee = find_knee(loads, saturating(loads, 60))   # a repeated load: no zero denominator
    assert knee is not None and knee.load == 60


def test_a_flat_curve_has_no_knee():
    assert find_knee([10, 20, 40, 80, 160], [500.0] * 5) is None
    assert find_knee([10, 20, 40, 80, 160], [0.0] * 5) is None


def test_a_curve_flat_within_a_few_percent_has_no_knee():
    # saturated before the first load: a 1% wobble up is not a knee
    assert find_knee([50, 100, 200, 500], [660.0, 668.0, 668.0, 668.0]) is None


def test_a_falling_curve_has_no_knee():
    assert find_knee([10, 20, 40, 80], [400.0, 300.0, 200.0, 100.0]) is None


def test_a_straight_line_has_no_knee():
    loads = [10, 20, 30, 40, 50, 60]
    assert find_knee(loads, [5.0 * x for x in loads]) is None


def test_too_few_distinct_loads_have_no_knee():
    assert find_knee([10, 20], [100.0, 200.0]) is None
    assert find_knee([10, 10, 20], [100.0, 120.0, 200.0]) is None


def test_a_noisy_curve_keeps_its_knee_and_a_single_dip_is_not_one():
    rng = random.Random(7)
    loads = list(range(10, 210, 10))            # 20 points, knee at 100
    clean = saturating(loads, 100)
    noisy = [y * (1 + rng.uniform(-0.03, 0.03)) for y in clean]
    knee = find_knee(loads, noisy)
    assert knee is not None and 80 <= knee.load <= 120
    # a straight line with one outlier dip: the raw second difference would call it a knee
    line = [5.0 * x for x in loads]
    line[8] *= 0.6
    assert find_knee(loads, line) is None


def test_a_slope_that_recovers_is_not_a_knee():
    loads = [10, 20, 30, 40, 50, 60, 70]
    qps = [100, 200, 300, 310, 320, 420, 520]   # a pause, then it climbs again as fast
    assert find_knee(loads, qps) is None


def test_smoothing_removes_a_single_outlier_and_keeps_the_ends():
    values = [1.0, 2.0, 30.0, 4.0, 5.0, 6.0, 7.0]
    out = smooth(values)
    assert out[0] == 1.0 and out[-1] == 7.0 and max(out) < 8.0
