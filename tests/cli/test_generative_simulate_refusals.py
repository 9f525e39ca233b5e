"""`dynbatchctl simulate` on a generative config refuses, in one line with exit 2, the options it
does not model there (a trace's or a fixed token count: the scenario draws each request's prompt
and output lengths), instead of ignoring them. Config of test_generative_cli (no torch)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dynbatchd.cli.dynbatchctl import app
from test_generative_cli import generative_config


@pytest.mark.parametrize("option", [["--trace", "trace.csv"], ["--tokens", "128"]])
def test_a_generative_config_refuses_what_it_does_not_model(tmp_path, option):
    (tmp_path / "trace.csv").write_text("TIMESTAMP,ContextTokens\n0.0,100\n0.5,200\n")
    if option[0] == "--trace":
        option = ["--trace", str(tmp_path / "trace.csv")]
    result = CliRunner().invoke(app, ["simulate", "--config", str(generative_config(tmp_path)), *option])
    assert result.exit_code == 2
    assert "not modelled for a generative config" in result.output and option[0] in result.output
