"""`benchmarks.bound`: the fluid upper bound on requests on time, on cases small enough to
work out by hand, and above every schedule the replays make of a bursty trace."""

from __future__ import annotations

import random

import pytest

from benchmarks.bound import fluid_parts, most_on_time
from benchmarks.heuristics import edf_plan_drop_largest, feasible_shortest_first, fifo_drop_hopeless
from dynbatchd.config import ChannelSettings
from dynbatchd.simulate import Arrival, DeviceModel, simulate

MS = 1_000_000
FLAT = DeviceModel(base_ms=0.0, per_item_ms=0.0, per_token_ms=0.001)   # 1 ms per 1,000 tokens


def test_what_does_not_fit_is_served_in_part():
    # Three requests of 4 ms at once, due in 10 ms: two whole and half of the third (the last in
    # the fill order of equal worth per unit of time: the first found).
    parts = fluid_parts([Arrival(0, 4000)] * 3, FLAT, deadline_ms=10)
    assert parts.sum() == pytest.approx(2.5)


def test_runs_of_arrivals_share_the_time_between_the_first_arrival_and_the_last_deadline():
    # 6 ms each, due 8 ms after arrival. Arriving 5 ms apart they have 13 ms between them: both
    # fit. Arriving 3 ms apart they have 11 ms: 1 and 5/6.
    assert fluid_parts([Arrival(0, 6000), Arrival(5 * MS, 6000)], FLAT, 8).sum() == pytest.approx(2.0)
    assert fluid_parts([Arrival(0, 6000), Arrival(3 * MS, 6000)], FLAT, 8).sum() == pytest.approx(1 + 5 / 6)


def test_the_cheapest_requests_fill_first_and_a_floor_on_long_ones_is_priced_in():
    # Two requests of 2 ms and one of 6 ms at once, due in 8 ms: the most is both short ones and
    # two thirds of the long one. Asked to serve the long one whole, the most is the long one and
    # one short one.
    arrivals = [Arrival(0, 2000), Arrival(0, 6000), Arrival(0, 2000)]
    assert most_on_time(arrivals, FLAT, 8) == pytest.approx(2 + 4 / 6)
    assert most_on_time(arrivals, FLAT, 8, longest=[1], floor=1.0) == pytest.approx(2.0, abs=1e-3)


def test_a_request_that_cannot_finish_even_alone_gets_nothing():
    assert fluid_parts([Arrival(0, 9000)], FLAT, deadline_ms=8).sum() == 0.0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_schedule_the_replays_make_beats_the_bound(seed):
    # Bursts of mixed sizes on the device of benchmarks.bursty: the yardsticks and dynbatchd's
    # engine all stay under the bound, with or without a floor they meet.
    rng = random.Random(seed)
    device = DeviceModel(base_ms=8.0, per_item_ms=0.5, per_token_ms=0.002)
    arrivals = sorted((Arrival(int((b * 2000 + rng.random() * 300) * MS), rng.choice([200, 900, 1500, 7000]))
                       for b in range(6) for _ in range(250)), key=lambda a: a.at_ns)
    bound = most_on_time(arrivals, device, 1000)
    longest = [i for i, a in enumerate(arrivals) if a.tokens == 7000]
    for heuristic in (fifo_drop_hopeless, feasible_shortest_first, edf_plan_drop_largest):
        y = heuristic(arrivals, device, 1000)
        met = sum(y.on_time[i] for i in longest)
        assert sum(y.on_time) <= bound + 1e-6
        assert sum(y.on_time) <= most_on_time(arrivals, device, 1000, longest=longest, floor=met) + 1e-3
    r = simulate({"c": ChannelSettings(max_batch=32, deadline_ms=1000, window_ms=10, queue_limit=100_000)},
                 arrivals, device=device)
    assert r.total().on_time <= bound + 1e-6
    assert bound < len(arrivals)   # the bursts overload the device: the bound is not trivial


def test_the_command_prints_the_bound_and_how_much_of_it_is_partial_credit(tmp_path, capsys):
    # Three requests of 200,000 tokens at once on the benchmark's device (8 ms + 0.5 ms + 0.002 ms a
    # token), due in 1 s: each costs 400.5 ms and a batch's share of the fixed cost, 0.25 ms. Two
    # fit whole; the third gets what is left of the second, in part.
    from benchmarks.bound import main

    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "2023-11-16 18:15:46.000000,200000,10\n" * 3)
    assert main(["--trace", str(trace), "--speedups", "1"]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| x1 |")]
    bound, whole, part = (float(cell) for cell in row[0].strip("|").split("|")[1:])
    work = 400.5 + 8 / 32
    assert (whole, part) == (2, 1)
    assert bound == pytest.approx(2 + (1000 - 2 * work) / work, abs=0.05)
