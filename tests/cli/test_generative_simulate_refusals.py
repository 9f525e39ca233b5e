"""On a generative config, `dynbatchctl simulate` and `tune --generative` refuse what they do not
model, in one line with exit 2, instead of ignoring it: a trace or a fixed token count (the
scenario draws each request's prompt and output lengths), a channel the workload sends nothing.
Config of test_generative_cli (no torch)."""

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


def test_tune_generative_refuses_a_channel_the_workload_sends_nothing(tmp_path):
    """bulk has no ttft_ms / tpot_ms, so the mixed workload offers it nothing: every setting would
    score 0 for it, and tune says so instead of recommending by the other channels' figures."""
    path = generative_config(tmp_path)
    path.write_text(path.read_text() + "[channels.bulk]\nmax_batch = 8\nwindow_ms = 0\ndeadline_ms = 60000\n")
    result = CliRunner().invoke(app, ["--config", str(path), "tune", "bulk", "--generative", "--rate", "2"])
    assert result.exit_code == 2
    assert "gets none" in result.output and "realtime, standard" in result.output
