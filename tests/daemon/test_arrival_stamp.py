"""A request arrives when the daemon read it, not when its turn in the drain came: the front end
stamps each drain of messages once, with the engine's clock, and every request of it is queued
with that stamp (a real Daemon driven by hand with a fake clock: benchmarks.inprocess.build)."""

from __future__ import annotations

from benchmarks import inprocess
from dynbatchd import protocol as P


def test_every_request_of_one_drain_arrives_when_the_drain_was_read():
    daemon, front, _pool, loop = inprocess.build()
    first = [[b"client", P.encoder.encode(P.Request(id=i, model="noop", text="hello"))] for i in range(5)]
    front._on_messages(first)
    read = front.read_ns
    queued = [daemon._queued[(b"client", i)] for i in range(5)]
    # Handling each request reads the clock several times (2 us a reading here): stamped as its turn
    # came, the fifth would arrive tens of microseconds after the first, though it waited all along.
    assert [job.arrival_ns for job in queued] == [read] * 5
    assert daemon.clock() > read
    loop.run()   # (the pass that hands them to the device)

    later = [[b"client", P.encoder.encode(P.Request(id=i, model="noop", text="hello"))] for i in range(5, 7)]
    front._on_messages(later)
    assert front.read_ns > read
    assert {daemon._queued[(b"client", i)].arrival_ns for i in (5, 6)} == {front.read_ns}
