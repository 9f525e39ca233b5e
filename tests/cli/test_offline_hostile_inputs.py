"""The offline commands given hostile files, as an operator's script might: a trace too long to
replay, or spanning more simulated time than a run can finish, or with no rows; a directory or a
binary file where a trace or a device profile is expected; a misspelt --mode; a command group
without its command. Each is one ``error:`` line naming the input and the rule, exit 2, nothing on
stdout under --json: never a traceback, a run without end, or a report of nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dynbatchd.cli import limits
from dynbatchd.cli.dynbatchctl import app
from dynbatchd.simulate.traces import read_trace_csv

SHIPPED = str(Path(__file__).resolve().parents[2] / "etc" / "dynbatchd.toml")
BURST = "Timestamp,Request tokens\n"


@pytest.fixture
def no_run(monkeypatch):
    """A simulation that starts fails the test at once: a hostile trace let through would hang it."""
    def ran(*args, **kwargs):
        pytest.fail("a simulation started: the input was not refused first")
    monkeypatch.setattr("dynbatchd.cli.simulate.run_config", ran)


def refused(*args: str) -> str:
    """The one `error:` line (on stderr) of a command refused with exit 2; stdout stays empty."""
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert result.stdout.strip() == "", result.stdout
    return lines[0]


def trace(tmp_path: Path, text: str, name: str = "t.csv") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_trace_past_the_run_bound_is_refused_without_simulating(tmp_path, monkeypatch, no_run):
    monkeypatch.setattr(limits, "MOST_REQUESTS", 3)
    path = trace(tmp_path, BURST + "".join(f"{i},10\n" for i in range(5)))
    line = refused("simulate", "-c", SHIPPED, "--trace", path, "--json")
    assert path in line and "more than 3 requests" in line


def test_the_reader_stops_one_row_past_its_bound_not_at_the_end_of_the_file(tmp_path):
    path = trace(tmp_path, BURST + "0,1\n1,1\n2,1\n3,1\nbroken,row\n")   # line 6 is never read
    with pytest.raises(ValueError, match="more than 2 requests"):
        read_trace_csv(path, most=2)


def test_a_trace_spanning_more_simulated_time_than_a_run_finishes_is_refused(tmp_path, no_run):
    path = trace(tmp_path, BURST + "0,10\n100000000000,10\n")   # two rows 1e11 s apart, ×0.001: 1e14 s
    line = refused("simulate", "-c", SHIPPED, "--trace", path, "--compress", "0.001", "--json")
    assert "--trace" in line and "--compress" in line and "at most 10,000,000" in line


def test_a_trace_with_a_header_and_no_rows_is_refused_not_reported_as_a_run(tmp_path, no_run):
    path = trace(tmp_path, BURST)
    assert "no requests in it" in refused("simulate", "-c", SHIPPED, "--trace", path, "--json")


@pytest.mark.parametrize("args", [("simulate", "-c", SHIPPED, "--trace"), ("capacity", "-c", SHIPPED, "--trace"),
                                  ("-c", SHIPPED, "bench", "--simulated", "--quick", "--trace")])
def test_a_trace_that_cannot_be_read_is_named_with_the_reason(tmp_path, args):
    line = refused(*args, str(tmp_path))   # a directory
    assert f"{tmp_path}: cannot read: Is a directory" in line and "Errno" not in line


@pytest.mark.parametrize("command", ["plan", "capacity"])
@pytest.mark.parametrize("kind", ["binary", "directory"])
def test_a_device_profile_that_is_binary_or_a_directory_is_one_line_naming_it(tmp_path, command, kind):
    path = tmp_path / "p.toml"
    if kind == "binary":
        path.write_bytes(b"\x8e\xff\x00" * 100)
    else:
        path.mkdir()
    line = refused(command, "-c", SHIPPED, "--profile", str(path))
    assert str(path) in line and ("not UTF-8 text" in line or "cannot read" in line)


def test_a_misspelt_mode_is_refused_on_any_config(no_run):
    assert "--mode must be continuous, static or both" in refused("simulate", "-c", SHIPPED, "--mode", "bogus")


def test_a_command_group_without_its_command_says_which_it_needs():
    result = CliRunner().invoke(app, ["http-key"])
    assert result.exit_code == 2
    assert result.stderr.strip().endswith("http-key needs a command: create, revoke, list"), result.stderr


def test_a_good_trace_still_gives_valid_json(tmp_path):
    path = trace(tmp_path, BURST + "0,10\n0,20\n0.5,30\n")   # identical times are a burst, not an error
    result = CliRunner().invoke(app, ["simulate", "-c", SHIPPED, "--trace", path, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["requests"] == 3
