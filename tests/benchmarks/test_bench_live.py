"""`dynbatchctl bench` against a live daemon on the simulated runner, over its real sockets: rows
written, each cell's settings applied, and the channel's own settings restored at the end and
on Ctrl-C."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conftest import SIMULATED, start_daemon
from dynbatchd.cli.dynbatchctl import app
from dynbatchd.tuning import bench as B
from dynbatchd.tuning import cells
from dynbatchd.tuning.store import connect

runner = CliRunner()
MATRIX = ["--concurrency", "2,6", "--max-batch", "2,4", "--window-ms", "2", "--duration-s", "0.4",
          "--warmup-s", "0.1", "--mix", "1:0:0", "--model", "sim"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_live")
    running = start_daemon(tmp, SIMULATED)
    running.tmp = tmp
    yield running
    running.stop()


def loop_settings(daemon, channel="standard"):
    found = daemon.call("config")["channels"][channel]
    return found["max_batch"], found["window_ms"]


def bench(daemon, db, *args):
    return runner.invoke(app, ["--endpoint", daemon.endpoint, "--control", daemon.control, "--config",
                               str(daemon.config), "bench", "--db", str(db), "--out", str(db.parent / "out"),
                               *MATRIX, *args])


def test_a_live_matrix_records_every_cell_and_restores_the_channel(daemon, tmp_path, monkeypatch):
    before = loop_settings(daemon)
    seen: list[tuple[int, float]] = []
    original_run = B.LiveBench.run

    def spying_run(self, cell, **kw):        # what the daemon runs with while each cell is measured
        figures = original_run(self, cell, **kw)
        seen.append(loop_settings(daemon))
        return figures
    monkeypatch.setattr(B.LiveBench, "run", spying_run)
    result = bench(daemon, tmp_path / "db.sqlite", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["simulated"] is False and data["complete"] is True
    assert seen == [(2, 2.0), (2, 2.0), (4, 2.0), (4, 2.0)]
    assert loop_settings(daemon) == before
    assert data["restored"] == {"max_batch": before[0], "window_ms": before[1]}
    with connect(tmp_path / "db.sqlite") as db:
        rows = cells.query(db, channel="standard")
    assert len(rows) == 4 and not any(r["simulated"] for r in rows)
    assert all(r["qps"] > 0 and r["requests"] > 0 and r["on_time"] is not None for r in rows)
    assert {(r["max_batch"], r["load"]) for r in rows} == {(2, 2), (2, 6), (4, 2), (4, 6)}
    assert all(r["fill_rate"] is not None and 0 < r["fill_rate"] <= 1 for r in rows)
    assert all(r["device_utilisation"] is not None and 0 < r["device_utilisation"] <= 1 for r in rows)
    assert all(r["scheduling_efficiency"] is not None and 0 < r["scheduling_efficiency"] <= 1 for r in rows)


def test_ctrl_c_mid_matrix_still_restores_the_channel(daemon, tmp_path, monkeypatch):
    before = loop_settings(daemon)
    original_run = B.LiveBench.run
    calls = []

    def interrupted_run(self, cell, **kw):
        calls.append(cell)
        if len(calls) == 2:
            self.call("tune", channel=self.channel, max_batch=cell.max_batch, window_ms=cell.window_ms)
            raise KeyboardInterrupt    # as Ctrl-C would, with the cell's settings in force
        return original_run(self, cell, **kw)
    monkeypatch.setattr(B.LiveBench, "run", interrupted_run)
    result = bench(daemon, tmp_path / "db.sqlite", "--json")
    assert result.exit_code == 130, result.output
    data = json.loads(result.stdout)
    assert data["complete"] is False and "interrupted" in data["stopped"] and len(data["cells"]) == 1
    assert loop_settings(daemon) == before


def test_an_unknown_channel_is_refused_before_anything_changes(daemon, tmp_path):
    before = loop_settings(daemon)
    result = runner.invoke(app, ["--endpoint", daemon.endpoint, "--control", daemon.control, "--config",
                                 str(daemon.config), "bench", "--channel", "nonesuch", "--db",
                                 str(tmp_path / "db.sqlite"), *MATRIX])
    assert result.exit_code == 2 and "no such channel" in result.output
    assert loop_settings(daemon) == before
