"""dynbatchd.logs: the JSON formatter, the text format kept as it was, ids made safe for a log line,
and ``[daemon] log_format`` checked like every key. (A live daemon logging JSON, and request ids end
to end: tests/daemon/test_request_ids.py.)"""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest

from dynbatchd import config as cfgmod
from dynbatchd.logs import MAX_LOGGED_ID, TEXT_FORMAT, JsonFormatter, request_fields, safe_id


def record(message: str, *args, level=logging.INFO, extra=None, exc_info=None) -> logging.LogRecord:
    rec = logging.getLogger("dynbatchd").makeRecord("dynbatchd", level, __file__, 1, message, args, exc_info,
                                                   extra=extra)
    return rec


def test_json_line_has_time_level_logger_message_and_request_fields():
    rec = record("request %s on channel %s: %s", 7, "vault", "refused",
                 extra=request_fields(7, channel="vault", model="echo", code="refused", tenant=None))
    line = JsonFormatter().format(rec)
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["level"] == "info" and obj["logger"] == "dynbatchd"
    assert obj["message"] == "request 7 on channel vault: refused"
    assert obj["time"].endswith("Z") and obj["time"][10] == "T"   # ISO 8601, UTC
    assert (obj["request_id"], obj["channel"], obj["model"], obj["code"]) == (7, "vault", "echo", "refused")
    assert "tenant" not in obj   # None fields are left out


def test_json_line_of_a_worker_and_of_a_traceback_is_one_line():
    try:
        raise ValueError("boom")
    except ValueError:
        rec = record("failed", level=logging.ERROR, exc_info=sys.exc_info())
    line = JsonFormatter(worker="w0-cpu").format(rec)
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["worker"] == "w0-cpu" and obj["level"] == "error"
    assert "ValueError: boom" in obj["exception"]


def test_text_format_is_unchanged():
    assert TEXT_FORMAT == "%(asctime)s %(name)s %(levelname)s %(message)s"
    out = logging.Formatter(TEXT_FORMAT).format(record("hello %d", 3))
    assert out.endswith(" dynbatchd INFO hello 3")


@pytest.mark.parametrize("given, logged", [
    (7, 7), ("abc-123", "abc-123"), (True, None), ([1], None), (None, None), (1.5, None),
    ("a\nb\x1bc\u00e9d", "abcd"),   # control and non-ASCII characters dropped
])
def test_safe_id(given, logged):
    assert safe_id(given) == logged


def test_safe_id_is_bounded():
    assert len(safe_id("x" * 10_000)) == MAX_LOGGED_ID
    assert safe_id("x" * 500, 128) == "x" * 128


def test_setup_json_writes_one_object_per_line(monkeypatch):
    from dynbatchd import logs

    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers = []
    try:
        logs.setup("debug", "json", worker="w1-cpu")
        logging.getLogger("dynbatchd.worker").debug("model %s loaded", "echo")
        logging.getLogger("dynbatchd").info("request %s: %s", "r1", "model_error",
                                            extra=request_fields("r1", code="model_error"))
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers, level = saved
        root.setLevel(level)
        logging.captureWarnings(False)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["message"] for line in lines] == ["model echo loaded", "request r1: model_error"]
    assert all(line["worker"] == "w1-cpu" for line in lines)
    assert lines[1]["request_id"] == "r1" and lines[1]["code"] == "model_error"


def test_log_format_is_checked_and_defaults_to_text(tmp_path):
    path = tmp_path / "dynbatchd.toml"
    base = '[models.m]\nrunner = "simulated"\n[channels.c]\nmax_batch = 4\nwindow_ms = 5\n[routing]\ndefault = "c"\n'
    path.write_text(base)
    assert cfgmod.load(path).daemon.log_format == "text"
    path.write_text('[daemon]\nlog_format = "json"\n' + base)
    assert cfgmod.load(path).daemon.log_format == "json"
    path.write_text('[daemon]\nlog_format = "yaml"\n' + base)
    with pytest.raises(cfgmod.ConfigError, match="log_format"):
        cfgmod.load(path)
