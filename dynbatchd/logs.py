"""The daemon's and its workers' log lines: text (the default) or one JSON object per line.

``[daemon] log_format = "json"`` makes every line on stderr (the daemon's and its workers', which
share it and the journal) one JSON object::

    {"time": "2026-12-03T08:50:01.123Z", "level": "info", "logger": "dynbatchd",
     "message": "request 7 refused (channel medical)", "request_id": 7, "channel": "medical",
     "model": "minilm", "code": "refused"}

``time`` is ISO 8601 in UTC; ``worker`` names a worker process; a line about one request adds the
fields it knows of `FIELDS` (passed as ``extra=request_fields(...)``); ``exception`` holds a
traceback, in the same one line. The text format is the one the daemon always had.

A request id in a log line is the client's own id (ZeroMQ) or the ``X-Request-Id`` of an HTTP
request, passed through `safe_id`: an int, or a string of printable ASCII cut to `MAX_LOGGED_ID`
characters. Never the request's content, which no log line may hold (tests/daemon/test_no_payload_in_logs.py).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import datetime, timezone
from typing import Any, Callable

FORMATS = ("text", "json")
FIELDS = ("request_id", "channel", "model", "tenant", "code", "rule")   # a request's, in this order
MAX_ID = 128           # an X-Request-Id's characters (longer ones are cut)
MAX_LOGGED_ID = 160    # an id in a log or audit line: MAX_ID plus an input's index ("ID#12")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def safe_id(value: Any, limit: int = MAX_LOGGED_ID) -> int | str | None:
    """`value` fit for a log line: an int as is; a string with its characters outside printable
    ASCII dropped, cut to `limit`; anything else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        if not (value.isascii() and value.isprintable()):
            value = "".join(c for c in value if " " <= c <= "~")
        return value[:limit]
    return None


def request_fields(request_id: Any, **fields: Any) -> dict[str, Any]:
    """The ``extra`` of a log line about one request: its id (made safe) and the other `FIELDS`
    given (None ones left out)."""
    return {"request_id": safe_id(request_id), **{k: v for k, v in fields.items() if v is not None}}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def __init__(self, worker: str | None = None):
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds")
                    .replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.worker is not None:
            line["worker"] = self.worker
        for name in FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def setup(level: str, log_format: str = "text", *, worker: str | None = None) -> None:
    """Log to stderr at `level` in `log_format`; `worker`: the worker process's name, if one."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(worker))
        logging.captureWarnings(True)   # a library's warning is a log line too, not raw stderr
    elif worker is not None:
        handler.setFormatter(logging.Formatter(f"%(asctime)s worker[{worker}] %(levelname)s %(message)s"))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])


class LineBudget:
    """How many lines about single requests to write, per kind (an answer's code): BURST at once,
    then PER_SECOND (or the `burst` and `per_second` given); the rest are left out and counted, the count carried by the next line written.
    A storm (a model failing every batch, a client flooding refused requests) once wrote a line a
    request: the loop spent its time on them, and journald, past its rate limit, dropped the
    service's lines wholesale, those that say what broke among them. Metrics count every answer."""

    BURST = 100
    PER_SECOND = 10.0

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, burst: int = BURST,
                 per_second: float = PER_SECOND):
        self._clock, self.burst, self.per_second = clock, burst, per_second
        self._kinds: dict[str, list[float]] = {}   # kind -> [lines it may write now, when counted, left out]

    def take(self, kind: str) -> int | None:
        """None: leave this line out (it is counted). Else write it, with how many were left out since
        the last line of its kind (mostly 0)."""
        now = self._clock()
        state = self._kinds.setdefault(kind, [float(self.burst), now, 0])
        state[0] = min(float(self.burst), state[0] + (now - state[1]) * self.per_second)
        state[1] = now
        if state[0] < 1.0:
            state[2] += 1
            return None
        state[0] -= 1.0
        held, state[2] = int(state[2]), 0
        return held

    def admit(self, kind: str) -> str | None:
        """`take`, as the tail of the line to write: "" or " (and N more since the last such line)";
        None: leave the line out."""
        held = self.take(kind)
        return None if held is None else f" (and {held} more since the last such line)" if held else ""
