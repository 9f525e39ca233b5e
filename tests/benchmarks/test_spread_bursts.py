"""`benchmarks.spread_bursts`: its bursts, and a short replay checked for what it prints (SIMULATED)."""

from __future__ import annotations

from benchmarks import spread_bursts


def test_bursts_are_spread_over_their_window_and_a_gap_apart():
    # 20-40 requests within 20 ms, bursts 150-300 ms apart: a gap of over 100 ms starts a burst.
    times_ms = [a.at_ns / 1e6 for a in spread_bursts.spread_bursts(seed=1, seconds=2.0)]
    assert times_ms == sorted(times_ms)
    bursts: list[list[float]] = []
    for t in times_ms:
        if bursts and t - bursts[-1][0] < 100:
            bursts[-1].append(t)
        else:
            bursts.append([t])
    assert len(bursts) >= 2000 / 300
    assert all(20 <= len(b) <= 40 and b[-1] - b[0] <= 20 for b in bursts)


def test_it_prints_a_row_per_seed_and_their_sum(capsys):
    assert spread_bursts.main(["--seeds", "1,2", "--seconds", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("python -m benchmarks.spread_bursts --seeds 1,2 --seconds 2") and "SIMULATED" in out
    rows = {line.split("|")[1].strip(): [int(c.strip().replace(",", "")) for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| ") and not line.startswith("| seed")}
    assert set(rows) == {"1", "2", "all"}
    for requests, on_time, late, expired, fifo, plan in rows.values():
        assert on_time + late + expired <= requests and 0 < fifo <= requests and 0 < plan <= requests
    assert rows["all"] == [a + b for a, b in zip(rows["1"], rows["2"])]
