"""`capacity` with a mixed pool: one profile per device, searched in units of one device of each,
each device with its own cost curve and memory, priced and powered per device (SIMULATED)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dynbatchd import capacity as cap
from dynbatchd.cli.dynbatchctl import app
from dynbatchd.config import ChannelSettings
from dynbatchd.simulate import Arrival

MS = 1_000_000
SHIPPED = str(Path(__file__).resolve().parents[2] / "etc" / "dynbatchd.toml")
CHANNELS = {"only": ChannelSettings(max_batch=4, window_ms=2, deadline_ms=50)}
ARRIVALS = [Arrival(i * MS, 10, "only") for i in range(1000)]          # 1000/s for 1 s
BIG = cap.Profile(name="big", source="by hand", memory_gb=80.0, power_idle_w=10.0, power_busy_w=110.0,
                  price_per_hour=3.0, cost=cap.Cost(base_ms=10.0, per_item_ms=0.0))
SMALL = cap.Profile(name="small", source="by hand", memory_gb=24.0, power_idle_w=5.0, power_busy_w=25.0,
                    price_per_hour=1.0, cost=cap.Cost(base_ms=10.0, per_item_ms=0.0, memory_items=2))


def test_a_mixed_pool_is_searched_in_units_and_each_device_gets_batches_it_holds():
    # A unit serves 4 per 10 ms on the big device + 2 per 10 ms on the small one = 600/s: one unit
    # falls behind 1000/s, two (1200/s) keep up. The small devices' batches are cut to 2.
    sizing = cap.size(CHANNELS, ARRIVALS, [BIG, SMALL], {"only": 0.99}, batching=True, size_for_device=True)
    assert sizing.devices == 4
    assert {t.devices: t.holds for t in sizing.trials} == {2: False, 4: True}
    on_small = [b.size for b in sizing.result.batches if b.device % 2 == 1]
    assert on_small and max(on_small) <= 2 and not any(b.oom for b in sizing.result.batches)
    assert max(b.size for b in sizing.result.batches if b.device % 2 == 0) > 2   # the big ones ran bigger


def test_a_mixed_pools_cost_and_energy_add_up_per_device_kind():
    assert cap.pool_energy_j(4, [BIG, SMALL], [0.002, 0.004], 86_400) == pytest.approx(
        (2 * (10 + 5) * 86_400 + (100 * 0.002 + 20 * 0.004) * 86_400) / 86_400)
    # One kind is the plain formula.
    assert cap.pool_energy_j(3, [BIG], [0.01], 86_400) == cap.energy_per_request_j(3, BIG, 0.01, 86_400)

    class Fixed(cap.Traffic):
        def arrivals(self):
            return ARRIVALS
    data = cap.plan(CHANNELS, Fixed(86_400), [BIG, SMALL], {"only": 0.99}, size_for_device=True).as_dict()
    batched = data["batched"]
    assert (batched["devices"], batched["units"]) == (4, 2)
    assert batched["monthly_cost"] == pytest.approx(2 * (3.0 + 1.0) * cap.HOURS_PER_MONTH)
    assert data["profile"]["name"] == "big+small" and [d["name"] for d in data["profile"]["devices"]] == ["big", "small"]


def test_the_cli_takes_comma_separated_profiles_for_a_mixed_pool():
    result = CliRunner().invoke(app, ["capacity", "--config", SHIPPED, "--requests-per-day", "1M", "--duration", "2",
                                      "--profile", "h100-80gb,l4-24gb", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)["plans"][0]
    assert plan["profile"]["name"] == "h100-80gb+l4-24gb"
    assert plan["batched"]["devices"] == 2 * plan["batched"]["units"]
    bad = CliRunner().invoke(app, ["capacity", "--config", SHIPPED, "--profile", "h100-80gb,", "--json"])
    assert bad.exit_code == 2 and "separated by commas" in bad.output
