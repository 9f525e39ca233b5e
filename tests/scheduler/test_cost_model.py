"""The learned batch cost (dynbatchd/scheduler/cost.py): robust to what wedged channels before.

Each case is one a trial saw lock a channel: a few slow first batches, one slow batch among
fast ones, a noisy narrow range of batch sizes. Pure logic: batches are fed with their
measured times, no clock but the one passed in.
"""

from __future__ import annotations

import random

import pytest

from dynbatchd.scheduler import MS, CostModel

PER_ITEM_MS = 17.0   # what the device really takes, in these cases


def fed(batches, model: CostModel | None = None) -> CostModel:
    model = model or CostModel()
    for size, tokens, ms in batches:
        model.observe(size, tokens, int(ms * MS))
    return model


def fast(sizes) -> list[tuple[int, int, float]]:
    return [(n, 16 * n, PER_ITEM_MS * n) for n in sizes]


def test_slow_first_batches_are_forgotten_after_three_fast_ones():
    # The shipped config's first three batches (sizes 1, 4 and 5) took 3 s in all (a cold model on
    # a busy machine); the old fit then said 200 ms a request for ever.
    cost = fed([(1, 16, 1000), (4, 64, 900), (5, 80, 1100)] + fast([1, 2, 1]))
    assert cost.estimate_ns(1, 16) == pytest.approx(PER_ITEM_MS * MS, rel=0.05)
    assert cost.estimate_ns(4, 64) == pytest.approx(4 * PER_ITEM_MS * MS, rel=0.05)


def test_one_slow_batch_among_fast_ones_is_left_out():
    cost = fed([(1, 16, 9)] * 30 + [(1, 16, 398)])
    assert cost.estimate_ns(1, 16) == pytest.approx(9 * MS, rel=0.01)


def test_the_second_batch_alone_cannot_make_the_first_one_look_slow():
    # The realtime channel: 9 ms, then one of 398 ms; the old fit said 205.6 ms, past its 200 ms deadline.
    cost = fed([(1, 16, 9), (1, 16, 398)])
    assert cost.estimate_ns(1, 16) < 200 * MS


def test_a_pause_in_a_rare_bigger_batch_does_not_become_the_slope():
    # Batches of one, and now and then a batch of two slowed by a pause: the old fit made the pause a
    # 383 ms slope and clipped the intercept to 0, so a batch of one "took" 383 ms.
    cost = fed(fast([1] * 49) + [(2, 32, 400)] + fast([1] * 10))
    assert cost.estimate_ns(1, 16) < 2 * PER_ITEM_MS * MS


def test_a_noisy_narrow_range_of_sizes_and_tokens_keeps_its_estimates_near_the_measured():
    # 676 batches, mostly of one, tokens nearly proportional, 20% jitter and a pause now and then:
    # the old fit drifted to ~94 ms for a batch of one (the trial saw 1,165 ms per item).
    rng = random.Random(2)
    batches = []
    for _ in range(676):
        n = 1 if rng.random() < 0.97 else 2
        ms = PER_ITEM_MS * n * rng.uniform(0.8, 1.2) + (rng.random() < 0.05) * rng.uniform(200, 1500)
        batches.append((n, 16 * n + rng.randint(0, 3), ms))
    cost = fed(batches)
    assert cost.estimate_ns(1, 16) < 1.5 * PER_ITEM_MS * MS
    assert cost.estimate_ns(2, 32) < 1.5 * 2 * PER_ITEM_MS * MS
    assert all(c >= 0 for c in cost.coefficients())


def test_one_batch_claiming_far_more_tokens_than_ever_seen_cannot_zero_the_token_cost():
    # A client may declare any token count for a short text (the simulated runner costs by it, so the
    # daemon keeps it). A batch of "a billion tokens" that ran in 10 ms set the per-token cost to 0
    # (and tokens_matter False) for 200 batches after; now it is an outlier, and three in a row a new regime.
    rng = random.Random(1)
    sizes = [(n, n * rng.randint(50, 300)) for n in (rng.randint(1, 16) for _ in range(60))]
    cost = fed([(n, k, 8 + 0.5 * n + 0.01 * k) for n, k in sizes])
    before = cost.coefficients()
    fed([(2, 10**9, 9.5)], cost)
    assert cost.coefficients() == before and cost.tokens_matter
    fed([(2, 10**9, 9.5)] * 2, cost)   # the third in a row: the device really does not count them
    assert cost.coefficients()[2] == 0.0


def test_one_batch_size_only_gives_its_mean_time_and_no_slope():
    cost = fed([(8, 0, 10), (8, 0, 12)] * 10)
    assert cost.coefficients() == pytest.approx((11 * MS, 0.0, 0.0), rel=0.02)


def test_a_clean_linear_device_is_fitted_exactly():
    cost = fed([(n, 10 * n, 2 + 0.5 * n + 0.01 * 10 * n + 0.3 * (n % 3)) for n in range(1, 33)] * 2)
    base, per_item, per_token = cost.coefficients()
    assert cost.estimate_ns(16, 160) == pytest.approx((2 + 8 + 1.6 + 0.3) * MS, rel=0.1)
    assert min(base, per_item, per_token) >= 0


def test_a_device_that_really_slows_down_is_followed_after_three_batches():
    cost = fed(fast([4] * 30) + [(4, 64, 5 * 4 * PER_ITEM_MS)] * 3)
    assert cost.estimate_ns(4, 64) == pytest.approx(5 * 4 * PER_ITEM_MS * MS, rel=0.05)


def test_a_cost_is_trusted_to_refuse_only_once_settled_and_while_confirmed():
    cost = CostModel()
    for i in range(CostModel.SETTLED_AFTER - 1):
        cost.observe(1, 0, 10 * MS, now_ns=i * MS)
    assert not cost.trusted(20 * MS)          # too young
    cost.observe(1, 0, 10 * MS, now_ns=20 * MS)
    assert cost.trusted(20 * MS) and cost.trusted(20 * MS + CostModel.CONFIRMED_FOR_NS)
    assert not cost.trusted(20 * MS + CostModel.CONFIRMED_FOR_NS + 1)   # no batch measured lately: it lapses


def test_a_fit_far_above_the_last_batches_is_disputed_once_per_episode():
    # 20 batches of 40 ms, then ones of 9 ms (each left out as an outlier) with a 13 ms one between
    # them (not an outlier, so no three outliers in a row): the fit still says 40 ms.
    cost = fed([(1, 0, 40)] * 20 + [(1, 0, 9), (1, 0, 9), (1, 0, 13), (1, 0, 9), (1, 0, 9)])
    assert cost.estimate_ns(1) > 3 * cost.measured_ns(1)
    assert cost.disputed and cost.disputes == 1
    fed([(1, 0, 40)] * 3, cost)
    assert not cost.disputed
    fed([(1, 0, 9), (1, 0, 9), (1, 0, 13), (1, 0, 9), (1, 0, 9)], cost)
    assert cost.disputed and cost.disputes == 2


def test_measured_cost_scales_the_recent_batches_up_to_a_bigger_one():
    cost = fed([(4, 40, 10)] * 5)
    assert cost.measured_ns(1, 10) == 10 * MS     # a smaller batch costs no more than a measured one
    assert cost.measured_ns(8, 40) == 20 * MS     # twice the items: at most twice the time
    assert cost.measured_ns(4, 120) == 30 * MS    # three times the tokens: at most three times


@pytest.mark.parametrize("seed", range(40))
def test_the_written_out_fit_is_the_non_negative_least_squares_optimum(seed):
    # The fit's solves are written out (it runs once a batch on the daemon's result path); the
    # optimality (KKT) conditions check them independently: where a coefficient is positive the
    # error does not change along it, where it is 0 the error only grows as it rises.
    from dynbatchd.scheduler.cost import _nnls

    rng = random.Random(seed)
    shape = rng.choice(["free", "tokens-follow-size", "no-tokens", "one-size", "negative-slope"])
    rows = []
    for _ in range(rng.randint(3, 60)):
        n = 8 if shape == "one-size" else rng.randint(1, 64)
        k = 0 if shape == "no-tokens" else 3 * n if shape == "tokens-follow-size" else rng.randint(0, 4000)
        t = rng.uniform(0.2, 5) * MS + rng.uniform(-0.05, 1) * MS * n + rng.uniform(0, 2000) * k
        if shape == "negative-slope":
            t = 80 * MS - MS * n + rng.uniform(0, 5) * MS
        rows.append((1.0, float(n), float(k), t))
    a = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    b = [sum(r[i] * r[3] for r in rows) for i in range(3)]
    sums = [a[0][0], a[0][1], a[0][2], a[1][1], a[1][2], a[2][2], b[0], b[1], b[2]]
    coef = _nnls(sums)
    assert min(coef) >= 0
    for i in range(3):
        slope = sum(a[i][j] * coef[j] for j in range(3)) - b[i]   # half the error's derivative along coef[i]
        scale = 1e-6 * (abs(b[i]) + 1.0)
        if coef[i] > 0:
            assert abs(slope) <= scale, (shape, i, coef)
        else:
            assert slope >= -scale, (shape, i, coef)
