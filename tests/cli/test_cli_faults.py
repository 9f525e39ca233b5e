"""dynbatchctl's numbers and output paths, as a fuzzing pass found them: ``inf``, ``nan`` and
numbers too large for a run to finish are refused before any work, by one shared check that names
the option; an unwritable --out is refused before the run, not after it; a model config.json's
impossible dimension is one line naming its key. Never a traceback, never a run without end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dynbatchd.cli import capacity as capacity_cli, limits
from dynbatchd.cli.dynbatchctl import app

SHIPPED = str(Path(__file__).resolve().parents[2] / "etc" / "dynbatchd.toml")


@pytest.fixture
def no_run(monkeypatch):
    """Every simulation the commands start fails the test at once: a value let through would
    otherwise start a run without end, and the test would hang instead of failing."""
    def ran(*args, **kwargs):
        pytest.fail("a simulation started: the value was not refused first")
    for target in ("dynbatchd.cli.simulate.poisson_arrivals", "dynbatchd.cli.simulate.generative_data",
                   "dynbatchd.cli.simulate.run_config", "dynbatchd.capacity.plan",
                   "dynbatchd.cli.capacity.generative_capacity", "dynbatchd.tuning.bench.simulated_cell",
                   "dynbatchd.cli.tune_generative.recommend_generative"):
        monkeypatch.setattr(target, ran)


def refused(*args: str, code: int = 2) -> str:
    """The one `error:` line of a refused command (no traceback, exit `code`)."""
    result = CliRunner().invoke(app, list(args))
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    return lines[0]


@pytest.mark.parametrize("args, option", [
    (("simulate", "-c", SHIPPED, "--rate", "inf"), "--rate"),
    (("simulate", "-c", SHIPPED, "--rate", "nan"), "--rate"),
    (("simulate", "-c", SHIPPED, "--duration", "1e308"), "--duration"),
    (("simulate", "-c", SHIPPED, "--devices", "100000"), "--devices"),
    (("simulate", "-c", SHIPPED, "--base-ms", "inf"), "--base-ms"),
    (("capacity", "-c", SHIPPED, "--peak-factor", "inf"), "--peak-factor"),
    (("capacity", "-c", SHIPPED, "--requests-per-day", "1e30"), "--requests-per-day"),
    (("capacity", "-c", SHIPPED, "--requests-per-day", "inf"), "--requests-per-day"),
    (("-c", SHIPPED, "bench", "--simulated", "--rates", "inf"), "--rates"),
    (("-c", SHIPPED, "bench", "--simulated", "--rates", "nan"), "--rates"),
    (("-c", SHIPPED, "tune", "standard", "--generative", "--rate", "inf"), "--rate"),
    (("plan", "-c", SHIPPED, "--memory-gb", "inf"), "--memory-gb"),
    (("plan", "-c", SHIPPED, "--memory-gb", "1e300"), "--memory-gb"),
    (("infer", "m", "hello", "--timeout", "-1"), "--timeout"),
    (("infer", "m", "hello", "--timeout", "0"), "--timeout"),
    (("infer", "m", "hello", "--timeout", "nan"), "--timeout"),
    (("status", "--watch", "inf"), "--watch"),
])
def test_a_number_that_is_not_finite_or_past_its_bound_is_refused_naming_the_option(no_run, args, option):
    assert option in refused(*args)


@pytest.mark.parametrize("args", [
    ("simulate", "-c", SHIPPED, "--rate", "100000", "--duration", "3600"),
    ("capacity", "-c", SHIPPED, "--requests-per-day", "1e10"),
    ("-c", SHIPPED, "bench", "--simulated", "--rates", "100000", "--duration-s", "100"),
])
def test_a_run_of_too_many_simulated_requests_is_refused_before_it_starts(no_run, args):
    line = refused(*args)
    assert f"at most {limits.MOST_REQUESTS:,}" in line


def test_the_bounds_are_those_dynbatchctl_1_documents():
    page = (Path(__file__).resolve().parents[2] / "man" / "dynbatchctl.1.rst").read_text()
    for option in limits.MOST:
        assert f"``{option}``" in page, option
    assert f"{limits.MOST_REQUESTS:,}" in page


def test_capacity_refuses_an_unwritable_out_before_the_run(monkeypatch):
    monkeypatch.setattr(capacity_cli, "build", lambda *a, **k: pytest.fail("ran before checking --out"))
    line = refused("capacity", "-c", SHIPPED, "--out", "/nonexistent/dir/x.html")
    assert "--out" in line and "/nonexistent/dir/x.html" in line


def test_capacity_leaves_no_file_behind_when_it_checks_out(tmp_path, monkeypatch):
    out = tmp_path / "summary.html"
    monkeypatch.setattr(capacity_cli, "build", lambda *a, **k: (_ for _ in ()).throw(ValueError("stop here")))
    refused("capacity", "-c", SHIPPED, "--out", str(out))
    assert not out.exists()


def test_capacity_says_in_one_line_when_the_summary_cannot_be_written(tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(capacity_cli, "write_html", full_disk)
    line = refused("capacity", "-c", SHIPPED, "--requests-per-day", "100k", "--duration", "2",
                   "--out", str(tmp_path / "x.html"), "--json", code=1)
    assert "No space left on device" in line


def test_bench_refuses_an_unwritable_out_before_the_run(tmp_path):
    target = tmp_path / "a-file"
    target.write_text("")
    line = refused("-c", SHIPPED, "bench", "--simulated", "--quick", "--db", str(tmp_path / "t.sqlite"),
                   "--out", str(target / "pictures"))
    assert "--out" in line
    assert not (tmp_path / "t.sqlite").exists()   # nothing ran, nothing recorded


@pytest.mark.parametrize("key, value", [("num_hidden_layers", "1e400"), ("num_key_value_heads", "-2"),
                                        ("num_attention_heads", "0"), ("hidden_size", "64.5"),
                                        ("max_position_embeddings", "true")])
def test_plan_refuses_a_model_config_whose_dimension_is_not_a_positive_integer(tmp_path, key, value):
    dims = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 512,
            "max_position_embeddings": 512}
    text = json.dumps(dims).replace(f'"{key}": {dims[key]}', f'"{key}": {value}')
    (tmp_path / "config.json").write_text(text)
    line = refused("plan", "--model", str(tmp_path), "--memory-gb", "8")
    assert key in line and "positive integer" in line


def test_a_good_run_still_passes_the_checks():
    result = CliRunner().invoke(app, ["simulate", "-c", SHIPPED, "--rate", "200", "--duration", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["requests"] > 0
