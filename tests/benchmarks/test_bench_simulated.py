"""`dynbatchctl bench --simulated`: the matrix on the engine with the simulated device (SIMULATED),
its rows in the configuration database, the pictures and the knee."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from dynbatchd import config as cfgmod
from dynbatchd.cli.dynbatchctl import app
from dynbatchd.tuning import bench as B
from dynbatchd.tuning import cells
from dynbatchd.tuning.store import connect

SHIPPED = Path(__file__).resolve().parents[2] / "etc" / "dynbatchd.toml"
runner = CliRunner()
SMALL = ["--concurrency", "10,25,50,100", "--max-batch", "8", "--window-ms", "10", "--duration-s", "0.5",
         "--warmup-s", "0.1"]


def bench(tmp_path: Path, *args: str):
    return runner.invoke(app, ["--config", str(SHIPPED), "bench", "--simulated", "--db", str(tmp_path / "db.sqlite"),
                               "--out", str(tmp_path / "out"), *args])


def test_a_simulated_matrix_writes_rows_pictures_and_a_knee(tmp_path):
    result = bench(tmp_path, *SMALL, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["simulated"] is True and data["complete"] is True and len(data["cells"]) == 4
    assert {c["load"] for c in data["cells"]} == {10, 25, 50, 100}
    with connect(tmp_path / "db.sqlite") as db:
        stored = cells.query(db, run_id=data["run_id"])
    assert len(stored) == 4 and all(r["simulated"] and r["channel"] == "standard" for r in stored)
    assert all(r["qps"] > 0 and 0 <= r["on_time"] <= 1 and r["p50_ms"] <= r["p99_ms"] <= r["p999_ms"]
               for r in stored)
    knee = data["knees"]["max_batch=8 window_ms=10"]
    assert knee is not None and knee["load"] in {10, 25, 50, 100}
    png = Path(data["pictures"]["scatter_png"]).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and Path(data["pictures"]["knee_png"]).read_bytes()[:4] == b"\x89PNG"
    html = Path(data["pictures"]["scatter_html"]).read_text()
    assert "SIMULATED" in html and "cdn.plot.ly" not in html.split("<body>")[0] and len(html) > 1_000_000  # plotly.js embedded


def test_the_table_says_simulated_and_the_history_reads_it_back(tmp_path):
    result = bench(tmp_path, *SMALL)
    assert result.exit_code == 0, result.output
    assert "SIMULATED" in result.stdout and "knee max_batch=8 window_ms=10" in result.stdout
    history = runner.invoke(app, ["--config", str(SHIPPED), "bench", "--history", "--json", "--channel", "standard",
                                  "--db", str(tmp_path / "db.sqlite")])
    assert history.exit_code == 0, history.output
    assert len(json.loads(history.stdout)) == 4
    other = runner.invoke(app, ["--config", str(SHIPPED), "bench", "--history", "--json", "--channel", "bulk",
                                "--db", str(tmp_path / "db.sqlite")])
    assert json.loads(other.stdout) == []


def test_bad_axes_are_one_line_and_exit_2(tmp_path):
    for args, words in ((["--mix", "7:2"], "--mix"), (["--max-batch", "0"], "--max-batch"),
                        (["--concurrency", "5", "--rates", "10"], "not both"),
                        (["--channel", "nope"], "no such channel"), (["--window-ms", "x"], "--window-ms")):
        result = bench(tmp_path, *args)
        assert result.exit_code == 2, (args, result.output)
        assert words in result.output and "Traceback" not in result.output


def test_bigger_batches_serve_more_at_saturation_and_runs_repeat_exactly():
    cfg = cfgmod.load(SHIPPED)
    small, big = (B.Cell("standard", "minilm", b, 10.0, "closed", 200.0) for b in (4, 32))
    a = B.simulated_cell(cfg, small, duration_s=0.5, warmup_s=0.1)
    b = B.simulated_cell(cfg, big, duration_s=0.5, warmup_s=0.1)
    assert b.qps > a.qps and b.fill_rate > 0.5        # the fixed per-batch cost is shared by more requests
    again = B.simulated_cell(cfg, big, duration_s=0.5, warmup_s=0.1)
    assert again.as_dict() == b.as_dict()


def test_open_loop_rates_offer_what_they_say_below_capacity():
    cfg = cfgmod.load(SHIPPED)
    cell = B.Cell("standard", "minilm", 32, 10.0, "open", 100.0)
    f = B.simulated_cell(cfg, cell, duration_s=2.0, warmup_s=0.2)
    assert 70 <= f.qps <= 130 and f.on_time == 1.0      # Poisson at 100/s over 2 s, far below capacity


def test_the_matrix_is_every_combination_loads_innermost():
    m = B.matrix("standard", "sim", max_batch=(4, 8), window_ms=(10, 50), concurrency=(50, 100))
    assert len(m) == 8 and [c.load for c in m[:2]] == [50, 100] and m[0].max_batch == 4
    trace = B.matrix("standard", "sim", max_batch=(4,), window_ms=(10,), rates=(5,), trace="t.csv")
    assert trace[0].mix is None and trace[0].load_kind == "open"
