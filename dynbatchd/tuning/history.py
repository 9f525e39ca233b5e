"""History: every tuning step (proposal, risk, canary, promote, rollback, manual tune) with its
time, settings, figures and reason, in the shared tuning database (`tuning.store`).

The settings a channel ran before a change are in the row of that change (`before`), so
`tune --rollback` restores them without asking anyone to remember."""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

STEPS = ("proposal", "risk", "refused", "canary", "promote", "rollback", "manual", "restore")

SCHEMA = """CREATE TABLE IF NOT EXISTS tune_history (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    channel TEXT NOT NULL,
    step TEXT NOT NULL,
    before TEXT,
    after TEXT,
    figures TEXT,
    reason TEXT NOT NULL DEFAULT ''
)"""


def _ready(db: sqlite3.Connection) -> sqlite3.Connection:
    db.execute(SCHEMA)
    return db


def record(db: sqlite3.Connection, channel: str, step: str, reason: str, *, before: dict | None = None,
           after: dict | None = None, figures: dict | None = None, at: float | None = None) -> int:
    """Add one step; returns its id."""
    if step not in STEPS:
        raise ValueError(f"unknown history step {step!r} (one of {', '.join(STEPS)})")
    with _ready(db):
        cur = db.execute("INSERT INTO tune_history (at, channel, step, before, after, figures, reason) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (time.time() if at is None else at, channel, step,
                          *(json.dumps(x) if x is not None else None for x in (before, after, figures)), reason))
    return int(cur.lastrowid)


def rows(db: sqlite3.Connection, channel: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
    """The latest steps, oldest first (of one channel, or of all)."""
    _ready(db)
    where, args = ("WHERE channel = ?", (channel,)) if channel else ("", ())
    found = db.execute(f"SELECT * FROM tune_history {where} ORDER BY id DESC LIMIT ?", (*args, limit)).fetchall()
    out = []
    for r in reversed(found):
        d = dict(r)
        for key in ("before", "after", "figures"):
            d[key] = json.loads(d[key]) if d[key] else None
        out.append(d)
    return out


CHANGES = ("promote", "manual", "restore")


def previous_settings(db: sqlite3.Connection, channel: str) -> dict[str, Any] | None:
    """What the channel ran before its last applied change (promote, manual tune or restore), or None."""
    _ready(db)
    r = db.execute("SELECT before FROM tune_history WHERE channel = ? AND step IN (?, ?, ?) AND before IS NOT NULL "
                   "ORDER BY id DESC LIMIT 1", (channel, *CHANGES)).fetchone()
    return json.loads(r["before"]) if r else None
