"""What a model's own code can do to the daemon (a `callable` runner, `model_faults:by_input`), end to end.

Each test sends a text naming a fault beside a batch-mate and a request to another model, and
checks that every request is answered once, that only the faulty input fails, and how the worker
fared (its pid, the log). Every wait is bounded: the client's own timeouts, or `wait_until`.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import start_daemon
from helpers import Failure, outcomes, wait_until

from dynbatchd.client import Client

BODY = """
    [models.fault]
    runner = "callable"
    options = { target = "model_faults:by_input" }
    [models.other]
    runner = "callable"
    options = { target = "model_faults:echo" }
    [channels.standard]
    max_batch = 8
    window_ms = 20
    deadline_ms = 60000
    [routing]
    default = "standard"
"""
WATCHDOG_S = 60   # far beyond the answers these tests wait for: a watchdog kill fails them


@pytest.fixture
def daemon(tmp_path):
    running = start_daemon(tmp_path, BODY, devices_extra=f"batch_timeout_s = {WATCHDOG_S}", cpu_threads=1)
    yield running
    running.kill()


def the_worker(daemon) -> tuple[int, int]:
    """(pid, restarts) of the one device's worker."""
    device = daemon.status()["devices"][0]
    return device["pid"], device["restarts"]


def beside_a_mate_and_a_bystander(client, fault: str) -> list:
    """The fault, a batch-mate of it and a request to the other model, sent together; their outcomes."""
    futures = [client.submit("fault", fault, timeout=20), client.submit("fault", "mate", timeout=20),
               client.submit("other", "bystander", timeout=20)]
    return outcomes(futures, timeout=30)


@pytest.mark.parametrize("fault", ["systemexit", "keyboard", "base"])
def test_a_model_raising_a_base_exception_fails_its_input_at_once_and_keeps_its_worker(daemon, fault):
    """SystemExit, KeyboardInterrupt or another BaseException from the model once ended the worker's
    device thread: its batch, and every model's batches on the device, waited for the watchdog."""
    worker = the_worker(daemon)
    with Client(daemon.endpoint) as client:
        got = beside_a_mate_and_a_bystander(client, fault)
        assert got[1:] == ["mate", "bystander"], got
        assert got[0] == Failure("model_error") and "failed on this input" in got[0].message, got
        assert client.infer("fault", "after", timeout=20) == "after"
    assert the_worker(daemon) == worker
    assert "killing it" not in daemon.logs() and "Traceback" not in daemon.logs()


@pytest.mark.parametrize("fault", ["surrogate", "deep"])
def test_an_output_the_wire_cannot_carry_is_model_error_alone_and_the_worker_lives(daemon, fault):
    """A lone surrogate or a list 5,000 deep could not be encoded, and the exception ended the
    worker, twice: a traceback each time, a rerun of its batch and the input quarantined for good."""
    worker = the_worker(daemon)
    with Client(daemon.endpoint) as client:
        got = beside_a_mate_and_a_bystander(client, fault)
        assert got[1:] == ["mate", "bystander"], got
        assert got[0] == Failure("model_error") and "could not be encoded" in got[0].message, got
        assert "\ud800" not in got[0].message
        assert client.infer("fault", "after", timeout=20) == "after"
    assert the_worker(daemon) == worker
    assert daemon.status()["daemon"]["quarantined"] == 0
    assert "Traceback" not in daemon.logs()


@pytest.mark.parametrize("fault", ["array-datetime", "array-timedelta"])
def test_an_array_of_a_dtype_without_a_buffer_is_model_error_and_the_worker_lives(daemon, fault):
    """datetime64 and timedelta64 arrays have no buffer to send: the worker died on them, twice."""
    worker = the_worker(daemon)
    with Client(daemon.endpoint) as client:
        got = beside_a_mate_and_a_bystander(client, fault)
        assert got[0] == Failure("model_error") and "could not be encoded" in got[0].message, got
        assert got[1] == "mate" or "could not be encoded" in got[1].message, got   # in its batch or not
        assert got[2] == "bystander"
        assert client.infer("fault", "after", timeout=20) == "after"
    assert the_worker(daemon) == worker
    assert daemon.status()["daemon"]["quarantined"] == 0
    assert "Traceback" not in daemon.logs()


def test_a_model_that_forks_a_child_holding_its_sockets_has_its_worker_replaced(daemon, tmp_path):
    """The worker exits, but a child it forked keeps its socket to the daemon open: its replacement
    (the same name) was refused by the daemon's socket, and the device stayed `starting` for good."""
    children = tmp_path / "children"
    pid, _ = the_worker(daemon)
    with Client(daemon.endpoint) as client:
        [got] = outcomes([client.submit("fault", f"fork:{children}", timeout=60)], timeout=70)
        assert got == Failure("model_error"), got   # it killed its worker twice: quarantined
        assert client.infer("other", "bystander", timeout=30) == "bystander"
    assert the_worker(daemon)[0] != pid
    forked = [int(line) for line in children.read_text().split()]
    assert len(forked) == 2
    wait_until(lambda: not any(alive(child) for child in forked), 10,
               message="a child forked by a dead worker's model still runs")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_model_that_exits_while_loading_stops_the_start_saying_why(tmp_path):
    """A SystemExit at a model's import ended the worker with status 0 and no word: the daemon
    restarted it until it gave the device up, and never said which model or why."""
    body = BODY.replace('"model_faults:by_input"', '"model_faults:exits_at_load"')
    with pytest.raises(RuntimeError, match="exited with 1 while starting") as failed:
        start_daemon(tmp_path, body, ready_timeout=60, cpu_threads=1)
    assert "could not start device workers: w0-cpu: SystemExit" in str(failed.value)


def test_what_a_model_prints_stays_out_of_the_log_while_its_workers_log_lines_reach_it(daemon):
    """Workers inherited the daemon's stdout: a model printing its inputs put payloads in the log."""
    printed = "print:a-payload-that-must-not-be-logged"
    with Client(daemon.endpoint) as client:
        assert beside_a_mate_and_a_bystander(client, printed) == [printed, "mate", "bystander"]
        [failed] = outcomes([client.submit("fault", "recursion", timeout=20)], timeout=30)
        assert failed == Failure("model_error"), failed
    # the worker's own warning about the failing batch (stderr) still reaches the log
    wait_until(lambda: "worker[w0-cpu] WARNING model fault failed a batch" in daemon.logs(), 10,
               message="the worker's own log line never reached the log")
    assert "a-payload-that-must-not-be-logged" not in daemon.logs()


def test_what_a_model_writes_to_stderr_is_counted_in_the_log_but_not_written_there(daemon):
    """A worker's stderr was the daemon's log: a model that printed its inputs to stderr put payloads there."""
    printed = "eprint:a-payload-for-stderr-only"
    with Client(daemon.endpoint) as client:
        assert beside_a_mate_and_a_bystander(client, printed) == [printed, "mate", "bystander"]
    line = f"model code wrote {len(printed)} characters to stderr in all; they are not logged"
    wait_until(lambda: line in daemon.logs(), 10, message="the withheld characters were never counted in the log")
    assert "a-payload-for-stderr-only" not in daemon.logs()


def test_a_model_load_error_whose_text_cannot_be_read_stops_the_start_naming_its_type(tmp_path):
    """An exception whose __str__ raises, while a model loads: formatting it for the Failed message
    raised again and ended the worker unheard; the daemon restarted it until it gave the device up."""
    body = BODY.replace('"model_faults:by_input"', '"model_faults:unprintable_at_load"')
    with pytest.raises(RuntimeError, match="exited with 1 while starting") as failed:
        start_daemon(tmp_path, body, ready_timeout=60, cpu_threads=1)
    assert "could not start device workers: w0-cpu: Unprintable (its message could not be read)" in str(failed.value)


def test_a_reloaded_model_whose_load_error_cannot_be_read_is_failed_and_the_worker_serves_on(daemon):
    """The same exception from a model a reload adds: the worker died reporting it, and with it
    every model it served."""
    pid = the_worker(daemon)[0]
    daemon.config.write_text(daemon.config.read_text() + '\n[models.late]\nrunner = "callable"\n'
                             'options = { target = "model_faults:unprintable_at_load" }\n')
    assert daemon.call("reload", timeout_s=30)["added"]["models"] == ["late"]
    failed = wait_until(lambda: daemon.status()["models"]["failed"], 30, message="the reloaded model never failed")
    assert failed["late"].endswith("Unprintable (its message could not be read)"), failed
    with Client(daemon.endpoint) as client:
        assert client.infer("fault", "after", timeout=20) == "after"
    assert the_worker(daemon)[0] == pid


def test_a_big_endian_array_is_answered_in_native_byte_order(daemon):
    """A `>f4` array went out as dtype '>f4', which the daemon refused: the whole batch model_error."""
    with Client(daemon.endpoint) as client:
        got = beside_a_mate_and_a_bystander(client, "array-bigendian")
    assert isinstance(got[0], np.ndarray) and got[0].dtype == np.float32 and got[0] == 0, got
    assert got[1] == "mate" or (isinstance(got[1], np.ndarray) and got[1] == 1), got   # in its batch or not
    assert got[2] == "bystander"


@pytest.mark.parametrize(("fault", "dtype"), [("array-object", "dtype object"), ("array-complex", "dtype complex128"),
                                               ("array-structured", "dtype [('f0'")])
def test_an_array_of_a_dtype_the_wire_does_not_carry_is_refused_by_the_worker_naming_it(daemon, fault, dtype):
    """An object array's pointer bytes went to the daemon, which refused the whole answer as
    'unsupported dtype' (so did it a complex or structured array's)."""
    worker = the_worker(daemon)
    with Client(daemon.endpoint) as client:
        got = beside_a_mate_and_a_bystander(client, fault)
        assert got[0] == Failure("model_error") and "could not be encoded" in got[0].message, got
        assert dtype in got[0].message and "wire carries" in got[0].message, got
        assert got[1] == "mate" or dtype in got[1].message, got   # in its batch or not
        assert got[2] == "bystander"
        assert client.infer("fault", "after", timeout=20) == "after"
    assert the_worker(daemon) == worker
    assert "answered batch" not in daemon.logs() and "Traceback" not in daemon.logs()
