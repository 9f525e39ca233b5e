"""The engine returns its audit decisions and canary verdicts as events instead of calling out
(issue 25), on a fake clock: nothing outside the engine runs during its call; the driver carries
the events out once the call has returned, each exactly once and in order."""

from __future__ import annotations

from dynbatchd import protocol as P
from dynbatchd.config import ChannelSettings
from dynbatchd.engine import ANONYMOUS_RULE, OK, AuditEvent, Engine, Job, Outcome, VerdictEvent
from dynbatchd.scheduler import build_channels

MS = 1_000_000
TWIN = "c~canary"


class LoggingJudge:
    """A canary judge that sends every request to the twin and rolls back on its first answer,
    writing in the shared log when it decides (which happens inside the engine's call)."""

    def __init__(self, log: list[str]):
        self.log, self.answered = log, 0

    def takes_next(self) -> bool:
        return True

    def record(self, candidate: bool, on_time: bool, latency_ns: int) -> None:
        self.answered += 1

    def record_batch(self, candidate: bool, device_ns: int) -> None:
        pass

    def decide(self, now_ns: int) -> str | None:
        if not self.answered:
            return None
        self.log.append("verdict decided")
        return "rollback"


class Driver:
    """What the daemon does around the engine, reduced to a log: it applies a verdict as a config
    change (retuning the channel, as apply_config does) and audits an isolation decision."""

    def __init__(self, engine: Engine, log: list[str]):
        self.engine, self.log, self.audited = engine, log, []

    def carry_out(self) -> None:
        for event in self.engine.take_events():
            if isinstance(event, VerdictEvent):
                self.log.append(f"verdict applied: {event.split.verdict}")
                channel = self.engine.channels[event.split.channel]
                channel.retune(ChannelSettings(max_batch=2, window_ms=0, deadline_ms=100), channel)
            else:
                self.audited.append((event.rule, event.action, event.job.payload))


def engine(**settings) -> Engine:
    channels = {"c": ChannelSettings(max_batch=4, window_ms=0, deadline_ms=100, **settings)}
    e = Engine(build_channels(channels), ["d0"])
    e.device_up(0)
    return e


def test_a_verdict_reached_inside_completed_is_applied_after_completed_returns():
    log: list[str] = []
    e = engine()
    driver = Driver(e, log)
    e.start_split("c", build_channels({TWIN: ChannelSettings(max_batch=4, window_ms=0, deadline_ms=100)})[TWIN],
                  LoggingJudge(log))
    for i in range(3):
        assert e.submit(Job("m", "c", 1, 100, i), 0) is None
    (dispatch,), answers = e.step(0)
    assert dispatch.batch.channel == TWIN and len(dispatch.batch.items) == 3 and answers == []
    answers = e.completed(0, dispatch.batch.id, Outcome(MS, ["out"] * 3), MS)
    log.append("completed returned")
    # the verdict came on the batch's first answer, yet the whole batch was answered and nothing
    # outside the engine ran: the split is over, its verdict waits in the outbox
    assert [a.code for a in answers] == [OK, OK, OK]
    assert "c" not in e.splits and log == ["verdict decided", "completed returned"]
    driver.carry_out()
    assert log == ["verdict decided", "completed returned", "verdict applied: rollback"]
    assert e.channels["c"].settings.max_batch == 2
    driver.carry_out()   # taken once: nothing is carried out twice
    assert log[-1] == "verdict applied: rollback" and len(log) == 3


def test_an_operators_stop_is_a_verdict_event_too():
    e = engine()
    e.start_split("c", build_channels({TWIN: ChannelSettings(max_batch=4, window_ms=0, deadline_ms=100)})[TWIN],
                  LoggingJudge([]))
    split = e.end_split("c", "stopped by the operator")
    assert e.take_events() == [VerdictEvent(split)] and not e.take_events()


def test_isolation_decisions_are_audit_events_in_order_and_nothing_else_is():
    e = engine(isolated=True, anonymous="refuse")
    refused = Job("m", "c", 1, 100, "anonymous")
    answer = e.submit(refused, 0)
    assert answer is not None and answer.code == P.REFUSED
    assert e.submit(Job("m", "c", 1, 100, "named", tenant="t1"), 0) is None   # a tenant: no decision
    assert e.take_events() == [AuditEvent(ANONYMOUS_RULE, "refused", refused)] and not e.take_events()
    alone = engine(isolated=True, anonymous="alone")
    driver = Driver(alone, [])
    for payload in ("first", "second"):
        assert alone.submit(Job("m", "c", 1, 100, payload), 0) is None
    driver.carry_out()
    assert driver.audited == [(ANONYMOUS_RULE, "ran alone", "first"), (ANONYMOUS_RULE, "ran alone", "second")]
    assert not alone.take_events()
