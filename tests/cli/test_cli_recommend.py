"""`dynbatchctl recommend`: settings from the daemon's observed traffic, searched on the simulator."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from dynbatchd import config as cfgmod
from dynbatchd.cli.dynbatchctl import app

SHIPPED = Path(__file__).resolve().parents[2] / "etc" / "dynbatchd.toml"


def observed(rate_standard: float, rate_realtime: float) -> dict:
    cost = {"base": 8.0, "per_item": 0.5, "per_token": 0.0, "samples": 50}
    channel = {"arrival_rps": 0.0, "mean_tokens": 200.0, "cost_ms": {**cost, "samples": 0}}
    return {"devices": [{"device": "cpu"}],
            "channels": {"standard": {**channel, "arrival_rps": rate_standard, "cost_ms": cost},
                         "realtime": {**channel, "arrival_rps": rate_realtime},
                         "bulk": dict(channel)}}


def fake_daemon(monkeypatch, status: dict, max_batch: int, window_ms: float) -> list:
    import dynbatchd.cli.recommend as rec

    cfg = cfgmod.with_channel(cfgmod.load(SHIPPED), "standard", max_batch=max_batch, window_ms=window_ms)
    tuned = []

    def control_call(endpoint, cmd, **args):
        if cmd == "tune":
            tuned.append(args)
            return {}
        return {"status": status, "config": cfgmod.to_dict(cfg)}[cmd]

    monkeypatch.setattr(rec, "control_call", control_call)
    return tuned


def test_an_overloaded_small_batch_setting_gets_a_larger_batch(monkeypatch):
    # 600 req/s into batches of 4 on a device that takes 8 ms + 0.5 ms per request: at most 400/s.
    tuned = fake_daemon(monkeypatch, observed(600.0, 50.0), max_batch=4, window_ms=10.0)
    result = CliRunner().invoke(app, ["recommend", "--json", "--duration", "2"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    std = plan["channels"]["standard"]
    assert plan["simulated"] is True and std["change"]
    assert std["recommended"]["max_batch"] > 4 and std["recommended"]["on_time"] > std["current"]["on_time"]
    assert "bulk" not in plan["channels"]            # no traffic there: nothing to recommend
    assert tuned == []                                # only --apply changes the daemon


def test_apply_tunes_the_daemon(monkeypatch):
    tuned = fake_daemon(monkeypatch, observed(600.0, 50.0), max_batch=4, window_ms=10.0)
    result = CliRunner().invoke(app, ["recommend", "--json", "--duration", "2", "--apply"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    [std] = [t for t in tuned if t["channel"] == "standard"]
    assert "standard" in plan["applied"]
    assert std["max_batch"] == plan["channels"]["standard"]["recommended"]["max_batch"]
    assert sorted(t["channel"] for t in tuned) == sorted(plan["applied"])


def test_no_learned_cost_yet_is_one_clear_error(monkeypatch):
    status = observed(600.0, 0.0)
    status["channels"]["standard"]["cost_ms"]["samples"] = 0
    fake_daemon(monkeypatch, status, max_batch=4, window_ms=10.0)
    result = CliRunner().invoke(app, ["recommend"])
    assert result.exit_code == 1 and "not run enough batches" in result.output
