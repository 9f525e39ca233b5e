"""A worker's ``sys.stderr`` is a `WithheldStream` (`dynbatchd.logs.withhold_stderr`): what model
code writes there may hold payloads, so it is counted, not written, and a log line says how much,
at most one a minute. The end-to-end check is in tests/devices/test_model_misbehaviour.py."""

from __future__ import annotations

from dynbatchd.logs import WithheldStream


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_the_first_write_is_noted_then_at_most_one_note_an_interval_with_the_running_total():
    clock, notes = FakeClock(), []
    stream = WithheldStream(notes.append, clock, every_s=60.0)
    assert stream.write("secret input\n") == len("secret input\n")
    assert stream.write("more") == 4
    clock.now += 59.9
    stream.write("x")
    assert notes == [len("secret input\n")]   # within the interval: counted, not noted
    clock.now += 0.1
    stream.write("yz")
    assert notes == [len("secret input\n"), len("secret input\n") + 4 + 1 + 2]
    assert stream.withheld == notes[-1]


def test_an_empty_write_notes_nothing_and_a_note_that_writes_to_stderr_does_not_recurse():
    notes: list[int] = []
    stream: WithheldStream

    def note(count: int) -> None:   # a failing log handler reports to stderr, which is this stream
        notes.append(count)
        stream.write("--- Logging error ---\n")

    stream = WithheldStream(note, FakeClock())
    stream.write("")
    assert notes == []
    stream.write("abc")
    assert notes == [3] and stream.withheld == 3 + len("--- Logging error ---\n")


def test_in_a_process_its_own_log_lines_uncaught_exceptions_and_warnings_still_reach_stderr():
    """Replacing sys.stderr also silenced what went there by default: tracebacks and warnings."""
    import subprocess
    import sys

    script = ("import logging, sys, threading, warnings\n"
              "from dynbatchd.logs import setup, withhold_stderr\n"
              "setup('info', worker='w0'); log = logging.getLogger('t'); withhold_stderr(log)\n"
              "print('PAYLOAD-TEXT', file=sys.stderr); log.info('own line')\n"
              "warnings.warn('a library warning')\n"
              "t = threading.Thread(target=lambda: 1 / 0, name='side'); t.start(); t.join()\n"
              "raise ValueError('boom')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    err = done.stderr
    assert done.returncode == 1
    assert "PAYLOAD-TEXT" not in err and "model code wrote 12 characters to stderr" in err, err
    assert "own line" in err and "a library warning" in err, err
    assert "uncaught ZeroDivisionError in thread side" in err and "uncaught ValueError" in err, err
    assert err.count("Traceback") == 2, err


def test_it_answers_what_libraries_ask_of_sys_stderr():
    """faulthandler, tqdm and the like ask sys.stderr for its descriptor and encoding."""
    stream = WithheldStream(lambda count: None, FakeClock())
    assert stream.fileno() == 2 and stream.encoding == "utf-8" and not stream.isatty()
    stream.flush()
    assert stream.withheld == 0
