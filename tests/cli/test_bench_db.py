"""The bench tables of the configuration database: schema, version, inserts and queries."""

from __future__ import annotations

import sqlite3

import pytest

from dynbatchd.tuning import cells
from dynbatchd.tuning.store import connect


def row(**over):
    base = {"run_id": "r1", "at": 1000.0, "simulated": True, "channel": "standard", "model": "sim",
            "max_batch": 8, "window_ms": 10.0, "policy": "fixed", "load_kind": "closed", "load": 50.0,
            "mix": "7:2:1", "trace": None, "requests": 100, "qps": 250.0, "p50_ms": 5.0, "p99_ms": 9.0,
            "p999_ms": 9.5, "on_time": 1.0, "device_utilisation": 0.5, "device_memory": 0.1, "fill_rate": 0.8,
            "scheduling_efficiency": 0.6, "commit_id": "abc1234", "config_hash": "0123456789ab"}
    base.update(over)
    return base


def test_the_schema_is_created_once_and_carries_its_version(tmp_path):
    db = connect(tmp_path / "t.sqlite")
    cells.ensure_schema(db)
    cells.ensure_schema(db)          # idempotent
    assert [tuple(r) for r in db.execute("SELECT version FROM bench_schema")] == [(cells.SCHEMA_VERSION,)]
    columns = {r["name"] for r in db.execute("PRAGMA table_info(bench_cells)")}
    assert set(cells.NAMES) | {"id"} == columns


def test_a_file_from_a_newer_schema_is_refused(tmp_path):
    db = connect(tmp_path / "t.sqlite")
    cells.ensure_schema(db)
    db.execute("INSERT INTO bench_schema (version) VALUES (?)", (cells.SCHEMA_VERSION + 1,))
    db.commit()
    with pytest.raises(sqlite3.DatabaseError, match="schema"):
        cells.ensure_schema(db)


def test_rows_come_back_newest_first_and_filter_by_channel_model_and_run(tmp_path):
    db = connect(tmp_path / "t.sqlite")
    cells.insert(db, row(at=1.0))
    cells.insert(db, row(at=2.0, channel="bulk", run_id="r2"))
    cells.insert(db, row(at=3.0, model="minilm", simulated=False, p999_ms=None))
    assert [r["at"] for r in cells.query(db)] == [3.0, 2.0, 1.0]
    assert [r["at"] for r in cells.query(db, channel="standard")] == [3.0, 1.0]
    assert [r["at"] for r in cells.query(db, channel="standard", model="sim")] == [1.0]
    assert [r["at"] for r in cells.query(db, run_id="r2")] == [2.0]
    live = cells.query(db, simulated=False)
    assert len(live) == 1 and live[0]["simulated"] is False and live[0]["p999_ms"] is None
    assert len(cells.query(db, limit=2)) == 2


def test_a_row_missing_a_required_column_is_refused_not_half_written(tmp_path):
    db = connect(tmp_path / "t.sqlite")
    with pytest.raises(ValueError, match="qps"):
        cells.insert(db, row(qps=None))
    assert cells.query(db) == []


def test_the_config_hash_is_stable_and_sensitive():
    a = cells.config_hash({"channels": {"standard": {"max_batch": 8}}, "b": 1})
    assert a == cells.config_hash({"b": 1, "channels": {"standard": {"max_batch": 8}}})
    assert a != cells.config_hash({"channels": {"standard": {"max_batch": 16}}, "b": 1})


def test_the_commit_is_a_git_hash_or_the_package_version(tmp_path):
    from dynbatchd import __version__
    assert cells.commit_id(tmp_path) == f"v{__version__}"     # not a checkout
    here = cells.commit_id()
    assert here == f"v{__version__}" or all(c in "0123456789abcdef" for c in here)


def test_live_utilisation_is_the_busy_time_between_two_snapshots():
    from dynbatchd.tuning.bench import _busy_between
    before = {"daemon": {"uptime_s": 100.0}, "devices": [{"busy_fraction": 0.1}]}      # 10 s busy
    after = {"daemon": {"uptime_s": 110.0}, "devices": [{"busy_fraction": 15 / 110}]}
    assert abs(_busy_between(before, after) - 0.5) < 1e-9                            # 5 s busy in 10 s
    assert _busy_between(before, {"daemon": {"uptime_s": 110.0}, "devices": []}) is None
