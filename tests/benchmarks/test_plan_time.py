"""`benchmarks.plan_time` on a tiny trace of its own: it times every batch the replay plans,
prints one row per speed-up with the command that made it, and leaves `Channel.form` as it was."""

from __future__ import annotations

from benchmarks import plan_time
from dynbatchd.scheduler.channel import Channel
from tests.benchmarks.test_bursty import write_trace


def test_it_times_every_batch_the_replay_plans(tmp_path):
    trace = tmp_path / "code.csv"
    write_trace(trace)
    form = Channel.form
    measured = plan_time.measure(trace, [40.0])["40"]
    assert Channel.form is form
    assert measured["batches"] > 0 and 0 <= measured["p50"] <= measured["p90"] <= measured["p99"]
    assert 0 <= measured["over_lead"] <= measured["batches"]


def test_it_prints_a_row_per_speed_up_with_its_command(tmp_path, capsys):
    trace = tmp_path / "code.csv"
    write_trace(trace)
    assert plan_time.main(["--trace", str(trace), "--speedups", "40,80"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("python -m benchmarks.plan_time --trace ")
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| x")]
    assert [(cells[1].strip(), cells[2].strip()) for cells in rows] == [("x40", "this"), ("x80", "this")]
    assert all(int(cells[3]) > 0 for cells in rows)
