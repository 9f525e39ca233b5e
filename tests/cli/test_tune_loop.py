"""The tuning loop's steps on the simulator (a virtual clock): search against a full grid, risk
refusal, canary promote and rollback, the history. Every figure here is SIMULATED."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from dynbatchd import config as cfgmod
from dynbatchd.plugins import Plugins
from dynbatchd.simulate import DeviceModel
from dynbatchd.tuning import collector, history
from dynbatchd.tuning.analyzer import ChannelModel
from dynbatchd.tuning.canary import PROMOTE, ROLLBACK, Canary, replay
from dynbatchd.tuning.recommender import BATCHES, WINDOWS_MS, Evaluator, Setting, search
from dynbatchd.tuning.risk import assess

SHIPPED = Path(__file__).resolve().parents[2] / "etc" / "dynbatchd.toml"
SECOND = 1_000_000_000


@pytest.fixture(scope="module")
def overloaded():
    """600 req/s at 8 ms + 0.5 ms/request: batches of 4 carry at most 400 req/s, so the running
    setting misses and the best setting is somewhere bigger (the grid says where)."""
    cfg = cfgmod.with_channel(cfgmod.load(SHIPPED), "standard", max_batch=4, window_ms=10.0)
    model = ChannelModel("standard", DeviceModel(8.0, 0.5, 0.0), 1, 600.0, 200, 3.0)
    return Evaluator(cfg, model, Plugins.load())


def test_search_ends_within_5_percent_of_the_full_grid(overloaded):
    best, score, incumbent, now = search(overloaded, trials=16, seed=3)
    grid = [overloaded(Setting(b, w)) for b in BATCHES for w in WINDOWS_MS]
    top = max(s.goodput_rps for s in grid if s is not None and s.on_time >= 0.99)
    assert now.on_time < 0.99, "the running setting should miss here, or the test shows nothing"
    assert score.on_time >= 0.99
    assert score.goodput_rps >= 0.95 * top


def test_risk_refuses_a_candidate_that_cannot_carry_the_traffic(overloaded):
    verdict = assess(overloaded, Setting(1, 0.0))
    assert not verdict.accepted
    assert "below the target" in verdict.reason
    assert verdict.predicted["x1"]["candidate"]["on_time"] < 0.99


def test_risk_refuses_what_the_compliance_rules_forbid(overloaded):
    banking = cfgmod.with_channel(overloaded.cfg, "standard", carries=["banking"], isolated=True)
    verdict = assess(Evaluator(banking, overloaded.model, overloaded.plugins), Setting(64, 200.0))
    assert not verdict.accepted
    assert "channels.standard.window_ms" in verdict.reason and "150" in verdict.reason


def test_risk_refuses_a_longer_p99_where_the_incumbent_meets_the_slo():
    cfg = cfgmod.with_channel(cfgmod.load(SHIPPED), "standard", max_batch=8, window_ms=5.0)
    quiet = Evaluator(cfg, ChannelModel("standard", DeviceModel(8.0, 0.5, 0.0), 1, 100.0, 200, 3.0), Plugins.load())
    verdict = assess(quiet, Setting(64, 500.0))
    assert not verdict.accepted and "p99" in verdict.reason


def _canary(evaluate, candidate, seconds=2.0, share=0.1):
    canary = Canary(share, int(seconds * SECOND), 0)
    channel = evaluate.model.channel
    verdict, result = replay(canary, channel, evaluate.cfg.channels[channel],
                             evaluate.config_for(candidate).channels[channel], evaluate.arrivals,
                             evaluate.model, **evaluate.kw)
    return canary, verdict, result


def test_canary_promotes_a_better_candidate(overloaded):
    canary, verdict, result = _canary(overloaded, Setting(32, 10.0))
    assert verdict.action == PROMOTE, verdict.reason
    served = [k for k in range(len(result.arrivals)) if result.channel_of[k].endswith("~canary")]
    assert 0.09 < len(served) / len(result.arrivals) < 0.11        # the share it was given
    assert verdict.figures["candidate"]["on_time"] >= 0.99          # no SLO breach on the canary's traffic


def test_canary_rolls_back_a_candidate_that_misses_more(overloaded):
    # Batches of one cannot carry the canary's 180 req/s. (It used to be decided early, on its
    # misses alone, while the overloaded incumbent's queue had not yet reached its deadlines; since
    # admission refuses what the shared device's measured drain rate cannot serve in time, the
    # incumbent answers its own excess `overloaded` from the first half second, so the candidate's
    # misses are judged against that share: the early abort is tested in test_canary_split.py.)
    canary, verdict, _ = _canary(overloaded, Setting(1, 0.0), seconds=3.0, share=0.3)
    assert verdict.action == ROLLBACK
    assert verdict.figures["candidate"]["on_time"] < verdict.figures["incumbent"]["on_time"]


def test_canary_split_is_exact_and_deterministic():
    c = Canary(0.25, SECOND, 0)
    picks = [c.takes_next() for _ in range(400)]
    again = Canary(0.25, SECOND, 0)
    assert sum(picks) == 100 and picks == [again.takes_next() for _ in range(400)]


def test_canary_decides_only_when_its_time_is_up():
    c = Canary(0.5, 10 * SECOND, 0, min_answered=1)
    for _ in range(100):
        c.record(True, True, 5_000_000)
        c.record(False, True, 5_000_000)
    c.record_batch(True, 100_000_000)
    c.record_batch(False, 200_000_000)
    assert c.decide(5 * SECOND) is None
    verdict = c.decide(10 * SECOND)
    assert verdict.action == PROMOTE and "device time" in verdict.reason


def test_canary_rolls_back_what_is_no_better():
    c = Canary(0.5, SECOND, 0, min_answered=1)
    for _ in range(100):
        c.record(True, True, 5_000_000)
        c.record(False, True, 5_000_000)
    assert c.decide(SECOND).action == ROLLBACK


def test_collector_refuses_too_little_data_saying_how_much():
    status = {"devices": [{}], "channels": {"standard": {"arrival_rps": 50.0, "mean_tokens": 100.0, "offered": 30,
                                                         "cost_ms": {"base": 8, "per_item": 0.5, "per_token": 0,
                                                                     "samples": 3}}}}
    with pytest.raises(collector.NotEnoughData) as exc:
        collector.collect(status, "standard")
    assert "20 timed batches" in str(exc.value) and "has 3" in str(exc.value) and "has 30" in str(exc.value)
    status["channels"]["standard"].update(offered=500, cost_ms={"base": 8, "per_item": 0.5, "per_token": 0,
                                                                "samples": 40})
    assert collector.collect(status, "standard").cost_samples == 40


def test_history_keeps_every_step_and_the_settings_before_the_last_change(tmp_path):
    from dynbatchd.tuning.store import connect

    db = connect(tmp_path / "tuning.sqlite")
    history.record(db, "standard", "proposal", "best of 16", after={"max_batch": 32}, at=1.0)
    history.record(db, "standard", "promote", "better", before={"max_batch": 4, "window_ms": 10.0},
                   after={"max_batch": 32, "window_ms": 10.0}, at=2.0)
    history.record(db, "bulk", "manual", "by hand", before={"max_batch": 8}, after={"max_batch": 16}, at=3.0)
    assert [r["step"] for r in history.rows(db)] == ["proposal", "promote", "manual"]
    assert [r["step"] for r in history.rows(db, "standard")] == ["proposal", "promote"]
    assert history.previous_settings(db, "standard") == {"max_batch": 4, "window_ms": 10.0}
    assert history.previous_settings(db, "realtime") is None
    with pytest.raises(ValueError):
        history.record(db, "standard", "guess", "")
    db.close()
    again = sqlite3.connect(tmp_path / "tuning.sqlite")   # on disk, for the next command
    assert again.execute("SELECT count(*) FROM tune_history").fetchone()[0] == 3


def test_the_model_is_checked_against_live_bench_cells_only(overloaded):
    from dynbatchd.tuning.analyzer import cells_error

    cell = {"channel": "standard", "simulated": False, "load_kind": "open", "load": 600.0, "max_batch": 32,
            "window_ms": 10.0, "policy": "fixed", "on_time": 0.9, "p99_ms": 100.0}
    seen = []

    def run_setting(max_batch, window_ms, policy, rate):
        seen.append((max_batch, window_ms, policy, rate))
        return 1.0, 50.0
    assert cells_error(overloaded.model, [{**cell, "simulated": True}, {**cell, "load_kind": "closed"}],
                       run_setting) is None
    error = cells_error(overloaded.model, [cell], run_setting)
    assert seen == [(32, 10.0, "fixed", 600.0)]
    assert error == {"cells": 1, "on_time_error": 0.1, "p99_relative_error": 0.5}
