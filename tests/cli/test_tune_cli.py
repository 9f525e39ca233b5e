"""`dynbatchctl tune --auto / --history / --rollback` against a fake daemon that applies what it is told
(the loop's figures are SIMULATED; the history lives in the config's state_dir)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dynbatchd import config as cfgmod
from dynbatchd.cli import dynbatchctl as ctl
from dynbatchd.client import DynbatchdError

SHIPPED = Path(__file__).resolve().parents[2] / "etc" / "dynbatchd.toml"
runner = CliRunner()


class FakeDaemon:
    """Answers status (an overloaded standard channel), config and tune (applied, as the daemon does)."""

    def __init__(self, rate: float = 600.0, samples: int = 50):
        self.cfg = cfgmod.with_channel(cfgmod.load(SHIPPED), "standard", max_batch=4, window_ms=10.0)
        self.rate, self.samples, self.tunes, self.earlier = rate, samples, [], []

    def __call__(self, endpoint, cmd, **args):
        if cmd == "status":
            quiet = {"arrival_rps": 0.0, "mean_tokens": 0.0, "offered": 0,
                     "cost_ms": {"base": 0.0, "per_item": 0.0, "per_token": 0.0, "samples": 0}}
            return {"devices": [{"device": "cpu"}],
                    "channels": {"standard": {"arrival_rps": self.rate, "mean_tokens": 200.0, "offered": 5000,
                                              "on_time": 0.89, "p99_ms": 990.0, "max_batch": 4,
                                              "cost_ms": {"base": 8.0, "per_item": 0.5, "per_token": 0.0,
                                                          "samples": self.samples}},
                                 "realtime": quiet, "bulk": quiet}}
        if cmd == "config":
            return cfgmod.to_dict(self.cfg)
        if cmd == "tune":
            self.tunes.append(args)
            channel = args.pop("channel")
            for flag in ("force", "why"):
                args.pop(flag, None)
            if args.pop("rollback", False):   # one step back, as the daemon's drop-in does
                if not self.earlier:
                    raise DynbatchdError("no change of channel 'standard' to roll back; nothing to restore")
                self.cfg = self.earlier.pop()
            else:
                self.earlier.append(self.cfg)
                self.cfg = cfgmod.with_channel(self.cfg, channel, **args)
            return {"settings": cfgmod.to_dict(self.cfg.channels[channel]), "verdict": "accepted: (fake)"}
        raise AssertionError(cmd)


@pytest.fixture
def daemon(monkeypatch, tmp_path):
    config = tmp_path / "dynbatchd.toml"
    shipped = SHIPPED.read_text()
    assert "\n[daemon]\n" in shipped
    config.write_text(shipped.replace("\n[daemon]\n", f'\n[daemon]\nstate_dir = "{tmp_path / "state"}"\n', 1))
    fake = FakeDaemon()
    monkeypatch.setattr(ctl, "control_call", fake)
    # --window 0: this fake's counters stand still, so its rate meter is the observation;
    # --canary replay: it has no live traffic to run a canary on
    fake.invoke = lambda *a: runner.invoke(ctl.app, ["--control", "ipc:///ctl", "--config", str(config), *a,
                                                     *(["--window", "0", "--canary", "replay"] if "--auto" in a else [])])
    return fake


def steps(daemon, channel="standard"):
    result = daemon.invoke("tune", "--history", channel, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_auto_promotes_a_better_setting_and_rollback_restores_the_old_one(daemon):
    result = daemon.invoke("tune", "--auto", "standard", "--trials", "12", "--duration", "3",
                           "--canary-seconds", "3", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)["channels"][0]
    assert report["outcome"] == "promoted", report["reason"]
    assert report["canary"]["candidate"]["on_time"] >= 0.99
    assert daemon.cfg.channels["standard"].max_batch == report["candidate"]["max_batch"] > 4
    assert [s["step"] for s in steps(daemon)] == ["proposal", "risk", "canary", "promote"]
    assert daemon.invoke("tune", "--rollback", "standard").exit_code == 0
    assert (daemon.cfg.channels["standard"].max_batch, daemon.cfg.channels["standard"].window_ms) == (4, 10.0)
    assert steps(daemon)[-1]["step"] == "restore"


def test_a_planted_bad_candidate_is_refused_and_recorded(daemon):
    result = daemon.invoke("tune", "--auto", "standard", "--candidate", "max_batch=1,window_ms=0", "--duration", "3")
    assert result.exit_code == 0, result.output
    assert "refused" in result.output and "below the target" in result.output
    assert not daemon.tunes
    history = steps(daemon)
    assert [s["step"] for s in history] == ["proposal", "refused"]
    assert history[-1]["after"]["max_batch"] == 1
    assert "refused" in daemon.invoke("tune", "--history").output


def test_auto_refuses_too_little_data_saying_how_much(daemon):
    daemon.samples = 5
    result = daemon.invoke("tune", "--auto", "standard")
    assert result.exit_code == 1
    assert "20 timed batches" in result.output and "has 5" in result.output
    assert not daemon.tunes


def test_a_manual_tune_is_recorded_with_what_it_replaced(daemon):
    assert daemon.invoke("tune", "standard", "--window-ms", "20").exit_code == 0
    (step,) = steps(daemon)
    assert step["step"] == "manual" and step["before"]["window_ms"] == 10.0 and step["after"]["window_ms"] == 20.0


def test_rollback_with_no_history_says_so(daemon):
    result = daemon.invoke("tune", "--rollback", "standard")
    assert result.exit_code == 1 and "nothing to restore" in result.output


def test_modes_do_not_mix(daemon):
    result = daemon.invoke("tune", "standard", "--auto", "--window-ms", "5")
    assert result.exit_code == 2 and "one of" in result.output
