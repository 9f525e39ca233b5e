"""The bandit window policy on a fake clock: never past window_ms, the incumbent while uncertain,
an arm that misses the SLO dropped, and learning on the engine (simulated device)."""

from __future__ import annotations

import pytest

from dynbatchd.config import ChannelSettings, PolicySettings
from dynbatchd.plugins import Plugins
from dynbatchd.scheduler.policies import MS, CostModel, LaneState
from dynbatchd.simulate import DeviceModel, simulate
from dynbatchd_plugins.bandit import BanditWindow

SECOND = 1_000_000_000


def lane(queued: int, opened_ns: int = 0, deadline_ns: int = 10 * SECOND) -> LaneState:
    return LaneState(queued=queued, tokens=queued * 100, max_batch=32, opened_ns=opened_ns,
                     earliest_deadline_ns=deadline_ns, free_slots=1, cost=CostModel())


def bandit(**options) -> BanditWindow:
    return BanditWindow.factory("standard", ChannelSettings(max_batch=32, window_ms=40.0), options)


def test_it_is_registered_like_the_other_window_policies():
    assert "bandit" in Plugins.load().window_policies()


def test_no_arm_waits_longer_than_the_channel_window():
    b = bandit(windows=[0.0, 0.5, 1.0], caps=[0.5, 1.0])
    assert max(w for w, _ in b.arms) == 40.0 and max(c for _, c in b.arms) == 32
    for arm in b.arms:
        b.arm = arm
        assert b.window_ns(0, lane(1)) <= 40 * MS


def test_the_window_ends_before_the_earliest_deadline_less_the_batch_cost():
    b = bandit()
    assert b.arm == b.incumbent
    assert b.window_ns(0, lane(1, deadline_ns=20 * MS)) <= 20 * MS - 2 * MS


def test_it_plays_the_incumbent_until_the_incumbent_is_measured_and_safe():
    b = bandit(epoch_ms=100)
    assert b.choose(5) == b.incumbent
    from dynbatchd_plugins.bandit import _Stats

    missing = _Stats()
    missing.add(100.0, 100, 90)          # the incumbent itself misses: nothing else is risked
    b.stats[(5, b.incumbent)] = missing
    assert b.choose(5) == b.incumbent
    good = _Stats()
    good.add(100.0, 100, 100)
    b.stats[(5, b.incumbent)] = good
    assert b.choose(5) != b.incumbent    # now it explores, shortest window first
    assert b.choose(5)[0] == min(w for w, _ in b.arms)


def test_an_arm_that_missed_the_slo_is_not_chosen_again():
    from dynbatchd_plugins.bandit import _Stats

    b = bandit(windows=[0.0, 1.0], caps=[1.0], explore=1000)
    fast, slow = sorted(b.arms)
    ok, bad = _Stats(), _Stats()
    ok.add(50.0, 100, 100)
    bad.add(80.0, 100, 95)               # more on-time throughput, but 95% on time
    b.stats = {(3, slow): ok, (3, fast): bad}
    b._epochs = 1
    assert b.choose(3) == slow


def test_bad_options_are_one_clear_error():
    with pytest.raises(ValueError, match="windows"):
        bandit(windows=[2.0])
    with pytest.raises(ValueError, match="unknown option"):
        bandit(arms=3)


def test_on_the_engine_it_learns_and_keeps_the_slo():
    """A steady stream on a device whose batches cost 8 ms + 0.5 ms/request: the bandit moves off
    the incumbent once it is measured, and no epoch costs the SLO."""
    rate, seconds = 400, 12
    arrivals = [(int(i * SECOND / rate), 100, "standard") for i in range(rate * seconds)]
    settings = ChannelSettings(max_batch=32, window_ms=50.0, deadline_ms=200.0, queue_limit=4096,
                               window=PolicySettings(policy="bandit", options={"epoch_ms": 250}))
    plugins = Plugins.load()
    r = simulate({"standard": settings}, arrivals, device=DeviceModel(8.0, 0.5, 0.0),
                 window_policies=plugins.window_policies())
    window = r.snapshot["standard"]["window"]
    assert window["policy"] == "bandit" and window["learned"] >= 3
    assert r.total().on_time_fraction >= 0.99
