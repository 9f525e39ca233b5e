"""The configuration database: one SQLite file in the state directory, shared by `bench` (its
cells) and `tune` (its history). Each module creates its own tables with CREATE TABLE IF NOT
EXISTS, so either can be first to open the file."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from dynbatchd.config import DaemonSettings, state_path

DATABASE = "tuning.sqlite"


def database_path(settings: DaemonSettings) -> Path:
    """``STATE_DIR/tuning.sqlite`` (see ``[daemon] state_dir``)."""
    return state_path(settings, DATABASE)


def connect(path: str | Path) -> sqlite3.Connection:
    """Open (creating if needed) the database at `path`: rows by name, WAL so a reader never
    blocks the daemon or a running bench, and a busy timeout instead of 'database is locked'."""
    connection = sqlite3.connect(str(path), timeout=10.0)
    connection.row_factory = sqlite3.Row
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA foreign_keys=ON")
    return connection
