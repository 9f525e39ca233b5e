"""`dynbatchctl simulate` on a generative config gives each request its channel's deadline_ms, as
the daemon's intake does: a generation still running at its deadline ends deadline_exceeded (the
worker frees its KV) and does not count as within targets. Config of test_generative_cli, no torch."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from dynbatchd import config as cfgmod
from dynbatchd.cli.dynbatchctl import app
from dynbatchd.simulate.generative import config_generative_device, run_generative
from test_generative_cli import generative_config


def continuous(path) -> dict:
    result = CliRunner().invoke(app, ["simulate", "--config", str(path), "--rate", "2", "--duration", "30",
                                      "--mode", "continuous", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["modes"]["continuous"]["channels"]["standard"]


def test_a_channel_deadline_shorter_than_long_generations_ends_them(tmp_path):
    path = generative_config(tmp_path)
    loose = continuous(path)                  # standard's deadline 60 s: every request within targets
    assert loose["met"] == loose["requests"]
    path.write_text(path.read_text().replace("deadline_ms = 60000", "deadline_ms = 3000"))
    tight = continuous(path)                  # 3 s: the longest outputs (up to 512 tokens) cannot finish
    assert tight["requests"] == loose["requests"] and 0 < tight["met"] < loose["met"]
    cfg = cfgmod.load(path)
    report = run_generative(cfg, config_generative_device(cfg), rate_per_s=2.0, requests=60, seed=1,
                            mode="continuous")
    late = [f for f in report.finished if f.reason == "deadline_exceeded"]
    assert late and all(f.channel == "standard" and f.end_ms - f.arrival_ms >= 3000 for f in late)
    assert report.kv["kv_in_use_bytes"] == 0                  # their KV went back
