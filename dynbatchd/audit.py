"""The compliance audit trail: every refusal and every isolation decision, counted and written down.

A compliance officer asks "which rule refused what, and when". Each decision
that changes how a request runs (refused by a compliance check, refused or
run alone by an isolation rule) is counted per (rule, action) for `/metrics`
and `dynbatchctl status --compliance`, and appended to a JSON-lines file:

    {"time": "2026-12-03T08:50:01.123456+00:00", "rule": "isolated-needs-tenant",
     "action": "refused", "channel": "medical", "tenant": null, "request_id": 7}

An erasure (`dynbatchctl forget USER`) is a line of its own, not counted among the decisions:

    {"time": "...", "rule": "forget", "action": "erased", "user": "<HMAC-SHA256 of the id>",
     "tenant": null, "by": "local", "erased": {"sketch_users": 1, "cache_entries": 3, ...}}

Never a payload: the record names the request by its id only (the client's, or an HTTP request's
X-Request-Id, made safe as in log lines: `dynbatchd.logs.safe_id`), and a user by its keyed hash. Rotation is
left to logrotate (or journald, when the file is not used): a file moved or
deleted is noticed on the next record and a new one opened, so
``copytruncate`` is not needed.
"""

from __future__ import annotations

import logging
import os
from collections import Counter, deque
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgspec

from dynbatchd.logs import safe_id

log = logging.getLogger(__name__)

FILE_NAME = "audit.jsonl"


class Decision(msgspec.Struct):
    time: str
    rule: str
    action: str          # "refused" or "ran alone"
    channel: str
    tenant: str | None
    request_id: Any


class Erasure(msgspec.Struct):
    """A user erased (`dynbatchctl forget`): by its keyed hash, with counts, never a payload."""
    time: str
    rule: str            # "forget"
    action: str          # "erased"
    user: str            # the user id's keyed hash (dynbatchd.pseudonyms)
    tenant: str | None   # the tenant it was limited to; None: every tenant
    by: str              # the control key's name, or "local"
    erased: dict[str, int]


class AuditLog:
    def __init__(self, path: str | os.PathLike | None, recent: int = 20):
        self.path = Path(path) if path is not None else None   # None: counted, not written
        self.counts: Counter[tuple[str, str]] = Counter()
        self.recent: deque[Decision] = deque(maxlen=recent)
        self.write_errors = 0
        self._file: Any = None
        self._inode: tuple[int, int] | None = None

    def record(self, rule: str, action: str, channel: str, tenant: str | None, request_id: Any) -> None:
        decision = Decision(datetime.now(timezone.utc).isoformat(), rule, action, channel, tenant,
                            safe_id(request_id))
        self.counts[(rule, action)] += 1
        self.recent.append(decision)
        if self.path is not None:
            self._write(msgspec.json.encode(decision) + b"\n")

    def erasure(self, user_key: str, tenant: str | None, by: str, erased: dict[str, int]) -> None:
        """Record that a user was erased: its keyed hash and the counts, never its id or inputs."""
        if self.path is not None:
            record = Erasure(datetime.now(timezone.utc).isoformat(), "forget", "erased", user_key, tenant, by, erased)
            self._write(msgspec.json.encode(record) + b"\n")

    def _write(self, line: bytes) -> None:
        try:
            if self._file is None or self._moved():
                self._reopen()
            self._file.write(line)
            self._file.flush()
        except OSError as exc:
            self.write_errors += 1
            if self.write_errors == 1 or self.write_errors % 1000 == 0:
                log.error("cannot write the audit log %s: %s (%d records not written)", self.path,
                          exc.strerror, self.write_errors)

    def _moved(self) -> bool:
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            return True
        return (info.st_dev, info.st_ino) != self._inode

    def _reopen(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        self._file = os.fdopen(fd, "ab")
        info = os.fstat(fd)
        self._inode = (info.st_dev, info.st_ino)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def snapshot(self) -> dict[str, Any]:
        """What `status` shows: counts per rule and action, and the latest decisions."""
        return {"audit_log": str(self.path) if self.path else None,
                "decisions": [{"rule": r, "action": a, "count": n} for (r, a), n in sorted(self.counts.items())],
                "recent": [msgspec.structs.asdict(d) for d in self.recent],
                "write_errors": self.write_errors}
