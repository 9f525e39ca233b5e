"""`benchmarks.clairvoyant`: a schedule made knowing every arrival, checked to be one a device
could run (every request it counts on time when replayed batch by batch), never above the fluid
bound, beating an online rule where foresight pays, and meeting a floor on long requests."""

from __future__ import annotations

import random

from benchmarks import clairvoyant
from benchmarks.bound import most_on_time
from benchmarks.heuristics import edf_plan_drop_largest
from dynbatchd.simulate import Arrival, DeviceModel

MS = 1_000_000
DEVICE = DeviceModel(base_ms=8.0, per_item_ms=0.5, per_token_ms=0.01)


def replay_on_time(arrivals: list[Arrival], served: list[bool], deadline_ms: float, max_batch: int = 32) -> list[bool]:
    """The served requests run in arrival order, each batch started when the device is free with
    every served request that has arrived: which finish by their deadline."""
    queue = sorted((i for i, s in enumerate(served) if s), key=lambda i: arrivals[i].at_ns)
    on_time = [False] * len(arrivals)
    now = 0
    while queue:
        now = max(now, arrivals[queue[0]].at_ns)
        batch = [i for i in queue[:max_batch] if arrivals[i].at_ns <= now]
        queue = queue[len(batch):]
        now += DEVICE.latency_ns(len(batch), sum(arrivals[i].tokens for i in batch))
        for i in batch:
            on_time[i] = now <= arrivals[i].at_ns + deadline_ms * MS
    return on_time


def bursts(seed: int, count: int = 300) -> list[Arrival]:
    rng = random.Random(seed)
    return [Arrival(int((i // 30) * 400 * MS + rng.random() * 60 * MS), rng.choice([50, 400, 1500, 6000]))
            for i in range(count)]


def test_knowing_a_burst_is_coming_it_leaves_the_long_request_that_would_block_it():
    # A long request at 0 runs for 98.5 ms; behind it, ten short ones at 1 ms all miss a 100 ms
    # deadline. An online rule sees only the long one at 0; the clairvoyant schedule does not run it.
    arrivals = [Arrival(0, 9000)] + [Arrival(1 * MS, 10)] * 10
    on_time = clairvoyant.witness(arrivals, DEVICE, 100.0)
    assert on_time == [False] + [True] * 10
    assert sum(edf_plan_drop_largest(arrivals, DEVICE, 100.0).on_time) == 1


def test_what_it_counts_on_time_is_on_time_when_run_and_never_above_the_bound():
    for seed in range(4):
        arrivals = bursts(seed)
        for start in (None, edf_plan_drop_largest(arrivals, DEVICE, 250.0).on_time):
            served = clairvoyant.witness(arrivals, DEVICE, 250.0, start=start, passes=2)
            assert 0 < sum(served) < len(arrivals)   # (the bursts overload the device: some must go)
            assert [s and ok for s, ok in zip(served, replay_on_time(arrivals, served, 250.0))] == served
            assert sum(served) <= most_on_time(arrivals, DEVICE, 250.0) + 1e-6


def test_a_floor_on_the_longest_requests_is_met_and_costs_requests():
    arrivals = bursts(7)
    longest = [i for i, a in enumerate(arrivals) if a.tokens == 6000]
    free = clairvoyant.witness(arrivals, DEVICE, 250.0, passes=2)
    served_long = sum(free[i] for i in longest)
    floor = served_long + 5
    fair = clairvoyant.witness_with_floor(arrivals, DEVICE, 250.0, longest, floor)
    assert sum(fair[i] for i in longest) >= floor
    assert [s and ok for s, ok in zip(fair, replay_on_time(arrivals, fair, 250.0))] == fair
    assert sum(fair) <= most_on_time(arrivals, DEVICE, 250.0, longest=longest, floor=floor) + 1e-6
    assert clairvoyant.witness_with_floor(arrivals, DEVICE, 250.0, longest, 0) == free


def test_it_prints_its_table_with_the_command(tmp_path, capsys):
    from tests.benchmarks.test_bursty import write_trace

    trace = tmp_path / "code.csv"
    write_trace(trace)
    assert clairvoyant.main(["--trace", str(trace), "--speedups", "40"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("python -m benchmarks.clairvoyant --trace ") and "SIMULATED" in out
    row = next(line for line in out.splitlines() if line.startswith("| x40 |")).split("|")
    witness, bound = int(row[3].split()[0]), float(row[4])
    fair_witness, fair_bound = int(row[5].split()[0]), float(row[6])
    assert witness <= bound and fair_witness <= fair_bound


def test_a_missing_trace_is_said_in_one_line(tmp_path, capsys):
    assert clairvoyant.main(["--trace", str(tmp_path / "absent.csv")]) == 2
    assert "absent.csv is missing" in capsys.readouterr().err
