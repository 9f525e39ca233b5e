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

import io
import json
import logging
import sys
import threading
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


class WithheldStream(io.TextIOBase):
    """A worker's ``sys.stderr`` once its log is set up (`withhold_stderr`): what model code writes
    there (a print of its inputs, a debug dump) is counted, not written, as it may hold payloads. A
    line says how much, at most one a `every_s`. The worker's own log lines keep the real stream."""

    def __init__(self, note: Callable[[int], None], clock: Callable[[], float] = time.monotonic,
                 every_s: float = 60.0):
        self._note, self._clock, self.every_s = note, clock, every_s
        self.withheld = 0           # characters written, all told
        self._noted_at: float | None = None
        self._noting = False        # (a failing log handler reports to stderr: not back into the note)

    encoding, errors = "utf-8", "strict"   # (some libraries read them off sys.stderr)

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        """The real descriptor (2): what writes there directly (faulthandler's crash dump, native
        code) is not Python's text, and reaches the log as before."""
        return 2

    def write(self, text: str) -> int:
        self.withheld += len(text)
        now = self._clock()
        if not self._noting and text and (self._noted_at is None or now - self._noted_at >= self.every_s):
            self._noted_at, self._noting = now, True
            try:
                self._note(self.withheld)
            finally:
                self._noting = False
        return len(text)


def withhold_stderr(log: logging.Logger) -> WithheldStream:
    """Keep what a worker's Python code writes to stderr out of the log (`WithheldStream`). An
    uncaught exception of the worker's own, in any thread, is still logged, with its traceback,
    through `log`, and so is a library's warning. What native libraries write to the file descriptor
    is not Python's, and stays."""
    logging.captureWarnings(True)
    stream = WithheldStream(lambda count: log.warning(
        "model code wrote %d characters to stderr in all; they are not logged, as they may hold request data", count))
    sys.stderr = stream
    sys.excepthook = lambda kind, exc, tb: log.critical("uncaught %s", kind.__name__, exc_info=(kind, exc, tb))
    threading.excepthook = lambda args: log.critical(
        "uncaught %s in thread %s", args.exc_type.__name__, getattr(args.thread, "name", "?"),
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback))
    return stream
