"""capacity --trace and bench --trace read a trace as simulate --trace does: at most
`limits.MOST_REQUESTS` rows, refused one row past it in simulate's one line, never read to the end
(3M rows once took 5.8 s and 650 MB). The bound is patched small; a broken row just past the first
row too many proves the reader stopped there."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from dynbatchd.cli import limits
from dynbatchd.cli.dynbatchctl import app

SHIPPED = str(Path(__file__).resolve().parents[2] / "etc" / "dynbatchd.toml")
COMMANDS = {
    "capacity": ["capacity", "-c", SHIPPED, "--requests-per-day", "1000", "--json", "--trace"],
    "bench": ["-c", SHIPPED, "bench", "--simulated", "--quick", "--json", "--trace"],
}


class Started(Exception):
    """A capacity trial or a bench cell began: the trace got past the reading."""


@pytest.fixture(autouse=True)
def no_run(monkeypatch):
    def ran(*args, **kwargs):
        raise Started
    monkeypatch.setattr("dynbatchd.capacity.size", ran)
    monkeypatch.setattr("dynbatchd.tuning.bench.simulated_cell", ran)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_trace_one_row_past_the_bound_is_refused_as_simulate_refuses_it(tmp_path, monkeypatch, command):
    monkeypatch.setattr(limits, "MOST_REQUESTS", 3)
    path = tmp_path / "t.csv"
    path.write_text("Timestamp,Request tokens\n" + "".join(f"{i * 100},10\n" for i in range(4)) + "broken,row\n")
    result = CliRunner().invoke(app, [*COMMANDS[command], str(path)])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0] == f"error: {path}: more than 3 requests; at most 3 a run (replay a part of it)"
    assert result.stdout.strip() == ""


@pytest.mark.parametrize("command", COMMANDS)
def test_a_trace_at_the_bound_is_run(tmp_path, monkeypatch, command):
    monkeypatch.setattr(limits, "MOST_REQUESTS", 3)
    path = tmp_path / "t.csv"
    path.write_text("Timestamp,Request tokens\n" + "".join(f"{i * 100},10\n" for i in range(3)))
    result = CliRunner().invoke(app, [*COMMANDS[command], str(path)])
    assert isinstance(result.exception, Started), result.output
