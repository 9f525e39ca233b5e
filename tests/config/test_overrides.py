"""The tuning drop-in on its own (`dynbatchd.overrides`): what a tune records, what a rollback
takes back (one step, then the config file's value), what a reload's file takes over, and that
the file reads back as it was written and refuses what no longer validates."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynbatchd import config as cfgmod
from dynbatchd.config import ConfigError
from dynbatchd.overrides import Overrides

SHIPPED = Path(__file__).resolve().parents[2] / "etc" / "dynbatchd.toml"


@pytest.fixture
def base():
    return cfgmod.with_channel(cfgmod.load(SHIPPED), "standard", max_batch=4, window_ms=10.0)


def running(o: Overrides, base, key: str):
    return getattr(o.apply(base).channels["standard"], key)


def test_a_tune_is_recorded_with_who_when_why_before_after_and_the_verdict(tmp_path, base):
    o = Overrides(tmp_path / "overrides.toml")
    o.record("standard", {"max_batch": 4}, {"max_batch": 16}, by="alice", why="more throughput",
             risk="accepted: within the SLO", forced=False)
    o.save()
    again = Overrides.load(tmp_path / "overrides.toml")
    (change,) = again.data.change
    assert (change.by, change.why, change.before, change.after, change.risk) == \
        ("alice", "more throughput", {"max_batch": 4}, {"max_batch": 16}, "accepted: within the SLO")
    assert change.at.tzinfo is not None
    assert again.describe()["standard"]["max_batch"]["by"] == "alice"
    assert running(again, base, "max_batch") == 16
    assert not list(tmp_path.glob(".*tmp")), "the temporary file of the atomic write is gone"


def test_rollback_steps_back_one_change_at_a_time_then_to_the_file(base):
    o = Overrides(None)
    o.record("standard", {"window_ms": 10.0}, {"window_ms": 20.0}, by="a", why="", risk="")
    o.record("standard", {"window_ms": 20.0}, {"window_ms": 30.0}, by="b", why="", risk="")
    assert running(o, base, "window_ms") == 30.0
    o.rollback("standard", base, by="c")
    assert running(o, base, "window_ms") == 20.0
    o.rollback("standard", base, by="c")
    assert "standard" not in o.data.channels and running(o, base, "window_ms") == 10.0
    assert o.rollback("standard", base, by="c") is None
    assert [c.source for c in o.data.change] == ["tune", "tune", "rollback", "rollback"]


def test_a_fixed_window_survives_the_file_as_an_empty_table(tmp_path, base):
    o = Overrides(tmp_path / "overrides.toml")
    slo = {"policy": "slo", "options": {}}
    o.record("standard", {"window": None}, {"window": slo}, by="a", why="", risk="")
    o.record("standard", {"window": slo}, {"window": None}, by="a", why="", risk="")
    o.save()
    assert running(Overrides.load(tmp_path / "overrides.toml"), base, "window") is None


def test_the_file_wins_for_the_keys_it_changed(base):
    o = Overrides(None)
    o.record("standard", {}, {"max_batch": 16, "window_ms": 20.0}, by="a", why="", risk="")
    new_file = cfgmod.with_channel(base, "standard", window_ms=50.0)
    assert o.reconcile(base, new_file) == ["channels.standard.window_ms"]
    tuned = o.apply(new_file).channels["standard"]
    assert (tuned.max_batch, tuned.window_ms) == (16, 50.0)


def test_an_override_that_no_longer_validates_names_its_key(tmp_path, base):
    path = tmp_path / "overrides.toml"
    o = Overrides(path)
    o.record("standard", {}, {"window_ms": 900.0}, by="a", why="", risk="")   # the deadline is 1000 ms
    o.save()
    shorter = cfgmod.with_channel(base, "standard", deadline_ms=500.0)
    with pytest.raises(ConfigError) as info:
        Overrides.load(path).apply(shorter)
    assert info.value.file == str(path) and info.value.key == "channels.standard.window_ms"


def test_a_drop_in_with_an_unknown_key_or_bad_toml_is_a_config_error(tmp_path):
    path = tmp_path / "overrides.toml"
    path.write_text('[channels.standard]\npriority = { value = 3, since = 2025-01-01T00:00:00Z, by = "a" }\n')
    with pytest.raises(ConfigError, match="channels.standard.priority: not a tunable setting"):
        Overrides.load(path)
    path.write_text("[channels\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        Overrides.load(path)
    assert Overrides.load(tmp_path / "missing.toml").data.channels == {}


def test_long_share_is_tunable_and_checked_like_the_file(tmp_path, base):
    path = tmp_path / "overrides.toml"
    o = Overrides(path)
    o.record("standard", {"long_share": 0.9}, {"long_share": 0.0}, by="a", why="most on time", risk="")
    o.save()
    assert running(Overrides.load(path), base, "long_share") == 0.0
    o.record("standard", {"long_share": 0.0}, {"long_share": 1.5}, by="a", why="", risk="")
    o.save()
    with pytest.raises(ConfigError) as info:
        Overrides.load(path).apply(base)
    assert info.value.key == "channels.standard.long_share"
