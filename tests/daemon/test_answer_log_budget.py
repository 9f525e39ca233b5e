"""Lines about single failed requests are budgeted (`dynbatchd.logs.LineBudget`): a storm of them
(a model failing every batch, a flood of refused requests) once wrote a line a request, and
journald, past its rate limit, then dropped the service's lines wholesale, those saying what broke
among them. Now BURST lines at once, then PER_SECOND, per answer code; the rest are counted, and
the count rides on the next line of that code."""

from __future__ import annotations

from conftest import SIMULATED, start_daemon
from dynbatchd.client import Client
from dynbatchd.logs import LineBudget
from helpers import outcomes, wait_until


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_is_written_then_the_rest_counted_into_the_next_line_written():
    clock = FakeClock()
    budget = LineBudget(clock)
    assert [budget.take("model_error") for _ in range(LineBudget.BURST)] == [0] * LineBudget.BURST
    assert [budget.take("model_error") for _ in range(5)] == [None] * 5   # left out, counted
    assert budget.take("refused") == 0   # another code has its own budget
    clock.now += 1.0 / LineBudget.PER_SECOND
    assert budget.take("model_error") == 5   # written, with the five left out before it
    assert budget.take("model_error") is None
    clock.now += 3600.0   # a long quiet refills the burst, no more
    assert [budget.take("model_error") for _ in range(LineBudget.BURST)] == [1] + [0] * (LineBudget.BURST - 1)
    assert budget.take("model_error") is None


def test_a_storm_of_model_errors_is_logged_within_the_budget_and_counted(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED, cpu_threads=1)
    try:
        storm = 3 * LineBudget.BURST
        with Client(daemon.endpoint, timeout=60) as client:
            futures = [client.submit("echo", "fail") for _ in range(storm)]
            assert outcomes(futures, timeout=60) == ["model_error"] * storm   # every request still answered

            def request_lines() -> list[str]:
                return [line for line in daemon.log_lines() if ": model_error (" in line]

            def left_out(line: str) -> int:   # what a line says was left out before it
                return int(line.split("(and ")[1].split()[0]) if "more since the last such line" in line else 0

            def accounted() -> int | None:   # one more failure a round, until the lines account for the storm
                outcomes([client.submit("echo", "fail")], timeout=30)
                lines = request_lines()
                total = len(lines) + sum(left_out(line) for line in lines)
                return total if total >= storm else None

            # (the budget refills while the storm is answered, so several lines may carry a count)
            wait_until(accounted, 30, message="the lines written and the counts they carry miss some of the storm")
        written = request_lines()
        assert len(written) < storm   # not a line a request
        assert any(left_out(line) for line in written)   # those not written were counted
    finally:
        daemon.stop()


def test_a_model_failing_every_batch_logs_within_the_budget(monkeypatch, caplog):
    """The worker's line a failed batch is budgeted per model the same way."""
    import logging

    from dynbatchd.devices import execution

    class AlwaysFails:
        def check(self, item):
            return None

        def run(self, inputs, tokens):
            raise RuntimeError("broken weights")

    clock = FakeClock()
    monkeypatch.setattr(execution, "failed_batch_lines", LineBudget(clock))
    with caplog.at_level(logging.WARNING, logger="dynbatchd.worker"):
        for _ in range(LineBudget.BURST + 5):
            run = execution.execute(AlwaysFails(), ["a"], [1], "m")
            assert run.errors   # every batch still answered with its error
        assert len([r for r in caplog.records if "failed a batch" in r.getMessage()]) == LineBudget.BURST
        clock.now += 1.0 / LineBudget.PER_SECOND
        execution.execute(AlwaysFails(), ["a"], [1], "m")
    assert "(and 5 more since the last such line)" in caplog.records[-1].getMessage()
