"""Bench cells in the configuration database: one row per measured cell of the matrix.

The "knowledge base of batching parameters": what a (channel, model,
max_batch, window, policy) did under a workload, on which commit and config.
Tables are created on first use (CREATE TABLE IF NOT EXISTS) with a schema
version in ``bench_schema``, so an old file is recognised, never misread.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any, Iterable

SCHEMA_VERSION = 1

COLUMNS = (   # name, SQL type: the row's config, workload, figures, provenance
    ("run_id", "TEXT NOT NULL"), ("at", "REAL NOT NULL"), ("simulated", "INTEGER NOT NULL"),
    ("channel", "TEXT NOT NULL"), ("model", "TEXT NOT NULL"), ("max_batch", "INTEGER NOT NULL"),
    ("window_ms", "REAL NOT NULL"), ("policy", "TEXT NOT NULL"),
    ("load_kind", "TEXT NOT NULL"), ("load", "REAL NOT NULL"), ("mix", "TEXT"), ("trace", "TEXT"),
    ("requests", "INTEGER NOT NULL"), ("qps", "REAL NOT NULL"), ("p50_ms", "REAL"), ("p99_ms", "REAL"),
    ("p999_ms", "REAL"), ("on_time", "REAL"), ("device_utilisation", "REAL"), ("device_memory", "REAL"),
    ("fill_rate", "REAL"), ("scheduling_efficiency", "REAL"), ("commit_id", "TEXT NOT NULL"),
    ("config_hash", "TEXT NOT NULL"),
)
NAMES = tuple(name for name, _ in COLUMNS)


def ensure_schema(db: sqlite3.Connection) -> None:
    """Create the tables if missing; refuse a file written by a newer schema than this code knows."""
    db.execute("CREATE TABLE IF NOT EXISTS bench_schema (version INTEGER NOT NULL)")
    row = db.execute("SELECT MAX(version) FROM bench_schema").fetchone()
    if row[0] is None:
        db.execute("INSERT INTO bench_schema (version) VALUES (?)", (SCHEMA_VERSION,))
    elif row[0] > SCHEMA_VERSION:
        raise sqlite3.DatabaseError(f"bench tables have schema {row[0]}; this dynbatchd knows {SCHEMA_VERSION}")
    cols = ", ".join(f"{n} {t}" for n, t in COLUMNS)
    db.execute(f"CREATE TABLE IF NOT EXISTS bench_cells (id INTEGER PRIMARY KEY AUTOINCREMENT, {cols})")
    db.execute("CREATE INDEX IF NOT EXISTS bench_cells_by_channel ON bench_cells (channel, model, at)")
    db.commit()


def insert(db: sqlite3.Connection, row: dict[str, Any]) -> int:
    """Store one cell; `row` has every column but id (missing figures None). Returns its id."""
    ensure_schema(db)
    missing = [n for n, t in COLUMNS if "NOT NULL" in t and row.get(n) is None]
    if missing:
        raise ValueError(f"bench cell lacks {', '.join(missing)}")
    values = [int(row[n]) if n == "simulated" else row.get(n) for n in NAMES]
    cur = db.execute(f"INSERT INTO bench_cells ({', '.join(NAMES)}) VALUES ({', '.join('?' * len(NAMES))})", values)
    db.commit()
    return int(cur.lastrowid)


def query(db: sqlite3.Connection, *, channel: str | None = None, model: str | None = None,
          run_id: str | None = None, simulated: bool | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """Cells, newest first, filtered by whichever of channel, model, run and simulated are given."""
    ensure_schema(db)
    where, args = [], []
    for name, value in (("channel", channel), ("model", model), ("run_id", run_id)):
        if value is not None:
            where.append(f"{name} = ?")
            args.append(value)
    if simulated is not None:
        where.append("simulated = ?")
        args.append(int(simulated))
    sql = "SELECT * FROM bench_cells" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY at DESC, id DESC"
    if limit is not None:
        sql += " LIMIT ?"
        args.append(int(limit))
    rows = [dict(r) for r in db.execute(sql, args)]
    for r in rows:
        r["simulated"] = bool(r["simulated"])
    return rows


def config_hash(config: Any) -> str:
    """A short, stable hash of a config (as a dict): which configuration a row ran on."""
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def commit_id(repo: Path | None = None) -> str:
    """The git short hash of the checkout this code runs from, else the package version."""
    here = repo or Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    from dynbatchd import __version__
    return f"v{__version__}"


def new_run_id() -> str:
    """A run's id: its UTC start time, sortable and readable (plus a nanosecond tail against clashes)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{time.time_ns() % 1_000_000:06d}"


def rows_of(cells: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Only the stored columns of each cell (for --json of fresh results and history alike)."""
    return [{n: c.get(n) for n in ("id",) + NAMES if n in c} for c in cells]
