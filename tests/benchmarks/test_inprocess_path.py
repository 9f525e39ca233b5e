"""benchmarks.inprocess drives a real Daemon's request path by hand (no sockets, no workers): every
request it hands in is answered once, at each batch size, and the figures it prints are per request."""

from __future__ import annotations

import pytest

from benchmarks import inprocess


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_every_request_handed_in_is_answered_once(batch):
    run, front = inprocess.driver(batch)
    sent = run(40) + run(10)
    assert sent == 50 * batch
    assert front.replies == sent          # one reply a request: none lost, none twice


def test_the_measure_is_a_time_a_request_for_each_batch_size():
    figures = inprocess.measure([1, 4], reps=1, requests=40)
    assert set(figures) == {"1", "4"} and all(us > 0 for us in figures.values())
