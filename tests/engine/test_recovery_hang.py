"""A hanging input costs one watchdog period, not two (issue 23), end to end.

The model (`helpers:echo_or_hang`) never returns from a batch holding a text starting "hang".
The watchdog's kills are read from the daemon's log ("has held a batch for more than N s"), so
the test checks what the daemon decided, not how fast this machine is: a request that hangs
alone is answered at the first kill; one that hangs a batch is found by a second, short kill
(the suspect limit, 1 s), not a second full period, and its batch-mates are answered.
"""

from __future__ import annotations

import re

from conftest import start_daemon
from helpers import outcomes

from dynbatchd.client import Client

TIMEOUT_S = 2.0
BODY = """
    [models.echo]
    runner = "callable"
    options = { target = "helpers:echo_or_hang" }
    [channels.standard]
    max_batch = 8
    window_ms = 20
    [routing]
    default = "standard"
"""
KILL = re.compile(r"has held a batch for more than ([\d.]+) s")


def kills(daemon) -> list[float]:
    """The limit of each watchdog kill so far, in order."""
    return [float(limit) for limit in KILL.findall(daemon.logs())]


def test_a_hanging_input_is_answered_after_one_period_and_its_batch_mates_run(tmp_path):
    daemon = start_daemon(tmp_path, BODY, devices_extra=f"batch_timeout_s = {TIMEOUT_S}")
    try:
        with Client(daemon.endpoint) as client:
            for i in range(3):   # the channel learns what a batch costs (a suspect's limit comes from it)
                assert client.infer("echo", f"warm{i}", deadline_ms=60_000, timeout=60) == f"warm{i}"

            # Alone: it used to run once more, alone, and hang a second full period.
            [hung] = outcomes([client.submit("echo", "hang1", deadline_ms=60_000, timeout=60)])
            assert hung == "model_error" and "hung" in hung.message and "quarantined" in hung.message
            assert kills(daemon) == [TIMEOUT_S]

            # In a batch: the batch is killed after one period; its requests rerun alone, and the
            # one that hangs again is killed after the short suspect limit.
            texts = ["a", "hang2", "b"]
            got = outcomes([client.submit("echo", t, deadline_ms=60_000, timeout=60) for t in texts])
            assert got == ["a", "model_error", "b"], got
            assert "quarantined" in got[1].message
            assert kills(daemon) == [TIMEOUT_S, TIMEOUT_S, 1.0]

            # Both are known now: refused at once, and the device serves.
            assert outcomes([client.submit("echo", "hang2", timeout=60)]) == ["model_error"]
            assert client.infer("echo", "after", deadline_ms=60_000, timeout=60) == "after"
        assert daemon.status()["daemon"]["quarantined"] == 2
        assert daemon.stop() == 0
    finally:
        daemon.kill()
