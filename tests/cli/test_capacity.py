"""Capacity planning: the pool search, the cost and energy arithmetic, device profiles and the CLI (SIMULATED)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dynbatchd import capacity as cap
from dynbatchd.cli.dynbatchctl import app
from dynbatchd.config import ChannelSettings, ConfigError
from dynbatchd.simulate import Arrival

SHIPPED = str(Path(__file__).resolve().parents[2] / "etc" / "dynbatchd.toml")
MS = 1_000_000

# The hand-worked case: one request every 1 ms for 1 s (1000/s), each batch takes 10 ms whatever its
# size, the deadline is 50 ms, and 99% must be on time.
CHANNELS = {"only": ChannelSettings(max_batch=4, window_ms=2, deadline_ms=50)}
ARRIVALS = [Arrival(i * MS, 10, "only") for i in range(1000)]
PROFILE = cap.Profile(name="hand", source="worked by hand", memory_gb=1.0, power_idle_w=10.0, power_busy_w=110.0,
                      price_per_hour=2.0, cost=cap.Cost(base_ms=10.0, per_item_ms=0.0))
TARGETS = {"only": 0.99}


def test_without_batching_the_pool_is_the_offered_rate_times_the_batch_time():
    # One at a time, a device serves 1000 / 10 ms = 100/s: 9 devices fall 100/s behind (after 0.5 s the
    # queue alone is 50 ms long, and half the run misses), 10 serve each arrival on a free device in 10 ms.
    sizing = cap.size(CHANNELS, ARRIVALS, PROFILE, TARGETS, batching=False)
    assert sizing.devices == 10
    tried = {t.devices: t.holds for t in sizing.trials}
    assert tried[9] is False and tried[10] is True
    assert sizing.result.mean_batch() == 1.0


def test_with_batching_a_device_serves_max_batch_per_batch_time():
    # Batches of 4 per 10 ms: 400/s a device. 2 devices (800/s) cannot keep up with 1000/s; 3 (1200/s) can.
    sizing = cap.size(CHANNELS, ARRIVALS, PROFILE, TARGETS, batching=True)
    assert sizing.devices == 3
    assert {t.devices: t.holds for t in sizing.trials}[2] is False
    assert sizing.result.mean_batch() > 3   # the pool holds only because batches fill


def test_monthly_cost_and_energy_per_request_by_hand():
    assert cap.monthly_cost(3, 2.0) == 3 * 2.0 * 730
    # 10 devices idle all day at 10 W, plus 100 W more for 10 ms per request, 86,400 requests a day:
    # (10 × 10 W × 86,400 s + 100 W × 0.01 s × 86,400) / 86,400 = 100 J + 1 J.
    assert cap.energy_per_request_j(10, PROFILE, 0.010, 86_400) == pytest.approx(101.0)


def test_the_plan_reports_savings_and_checks_the_guides_claims():
    class Fixed(cap.Traffic):
        def arrivals(self):
            return ARRIVALS
    data = cap.plan(CHANNELS, Fixed(86_400), PROFILE, TARGETS).as_dict()
    assert data["simulated"] is True
    assert (data["batched"]["devices"], data["unbatched"]["devices"]) == (3, 10)
    assert data["savings"]["devices"] == pytest.approx(0.7)
    assert data["savings"]["monthly_cost"] == pytest.approx(7 * 2.0 * 730)
    fewer = data["claims"][0]
    assert fewer["this_traffic"] == pytest.approx(0.7) and fewer["holds"] is True


def test_targets_give_the_highest_priority_channel_the_stricter_one():
    channels = {"rt": ChannelSettings(max_batch=1, window_ms=0, priority=2),
                "std": ChannelSettings(max_batch=1, window_ms=0, priority=1)}
    assert cap.targets_for(channels, 0.99, 0.9995) == {"rt": 0.9995, "std": 0.99}


@pytest.mark.parametrize("text, value", [("10M", 10e6), ("2.5k", 2500), ("1e6", 1e6), ("86_400", 86_400)])
def test_daily_volumes_parse(text, value):
    assert cap.parse_count(text) == value


def test_every_shipped_profile_loads_says_its_source_and_is_marked_an_estimate():
    names = cap.shipped_profiles()
    assert {"h100-80gb", "l4-24gb", "cpu-16core"} <= set(names)
    for name in names:
        p = cap.load_profile(name)
        assert p.estimate is True and p.source
        assert "ESTIMATES" in (cap.PROFILES_DIR / f"{name}.toml").read_text()
        assert p.device().latency_ns(1, 0) > 0


GOOD = """name = "mine"\nsource = "measured"\nmemory_gb = 16\npower_idle_w = 10\npower_busy_w = 50
price_per_hour = 1.0\n[cost]\nbase_ms = 2\nper_item_ms = 0.1\n"""


@pytest.mark.parametrize("text, key", [
    (GOOD.replace("base_ms = 2", "base_ms = -2"), "cost.base_ms"),
    (GOOD.replace("power_busy_w = 50", "power_busy_w = 5"), "power_busy_w"),
    (GOOD.replace("memory_gb = 16", "memory_gb = 0"), "memory_gb"),
    (GOOD + "watts = 3\n", "watts"),
    (GOOD.replace('source = "measured"\n', ""), "source"),
])
def test_a_bad_profile_names_the_key(tmp_path, text, key):
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        cap.load_profile(path)
    assert key in str(err.value)


def test_an_operators_profile_file_loads_and_an_unknown_name_lists_the_shipped_ones(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(GOOD)
    assert cap.load_profile(str(path)).cost.per_item_ms == 0.1
    with pytest.raises(ConfigError, match="h100-80gb"):
        cap.load_profile("no-such-gpu")


def test_the_cli_prints_json_writes_html_and_compares_two_profiles(tmp_path):
    html = tmp_path / "summary.html"
    args = ["capacity", "--config", SHIPPED, "--requests-per-day", "2M", "--duration", "3", "--json",
            "--profile", "l4-24gb", "--compare-profile", "cpu-16core", "--out", str(html)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["simulated"] is True
    assert [p["profile"]["name"] for p in data["plans"]] == ["l4-24gb", "cpu-16core"]
    for p in data["plans"]:
        for pool in (p["batched"], p["unbatched"]):   # the smallest pool that holds: one fewer was tried and failed
            tried = {t["devices"]: t["holds"] for t in pool["trials"]}
            assert tried[pool["devices"]] is True and tried.get(pool["devices"] - 1, False) is False
    assert data["comparison"]["devices_ratio"] == (data["plans"][1]["batched"]["devices"]
                                                   / data["plans"][0]["batched"]["devices"])
    text = html.read_text()
    assert "SIMULATED" in text and "l4-24gb" in text


def test_a_bad_profile_is_one_line_and_exit_2():
    result = CliRunner().invoke(app, ["capacity", "--config", SHIPPED, "--profile", "no-such-gpu"])
    assert result.exit_code == 2
    assert "unknown profile" in result.output


def test_a_target_no_pool_can_hold_is_reported_with_the_channel_not_searched_for_ever():
    # Every batch takes 10 ms and the deadline is 5 ms: no number of devices gets a request on time.
    channels = {"only": ChannelSettings(max_batch=4, window_ms=0, deadline_ms=5)}
    with pytest.raises(cap.Unattainable, match="only can reach at most 0.00% on time"):
        cap.size(channels, ARRIVALS[:200], PROFILE, TARGETS, batching=True)


def test_plan_takes_a_device_profiles_memory():
    result = CliRunner().invoke(app, ["plan", "--config", SHIPPED, "--profile", "l4-24gb", "--json"])
    assert result.exit_code == 0, result.output
    device = json.loads(result.output)["device"]
    assert device["total_bytes"] == 24 * 2**30 and device["source"] == "profile l4-24gb: memory_gb"
