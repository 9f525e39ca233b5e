"""Two feeders (worker processes) on one CPU device, live: both take batches, and killing one
loses no request while the other keeps answering, then it comes back."""

from __future__ import annotations

import os
import signal

from conftest import SIMULATED, start_daemon, wait_until

from dynbatchd.client import Client


def test_two_feeders_share_a_device_and_one_dying_loses_nothing(tmp_path):
    slow = SIMULATED.replace("base_ms = 2.0", "base_ms = 10.0")   # one feeder alone would queue
    daemon = start_daemon(tmp_path, slow, cpu_threads=1, devices_extra="workers_per_device = 2")
    try:
        [device] = daemon.status()["devices"]                  # one device, its two workers listed
        assert device["device"] == "cpu" and [w["name"] for w in device["workers"]] == ["w0.0-cpu", "w0.1-cpu"]
        with Client(daemon.endpoint) as client:
            futures = [client.submit("sim", f"r{i}", deadline_ms=60_000) for i in range(200)]
            assert all(f.result(timeout=60).output is not None for f in futures)
            workers = daemon.status()["devices"][0]["workers"]
            assert all(w["batches"] > 0 for w in workers), workers

            victim, other = workers
            futures = [client.submit("sim", f"k{i}", deadline_ms=60_000) for i in range(200)]
            os.kill(victim["pid"], signal.SIGKILL)
            # The other feeder keeps answering while the killed one is down or restarting.
            after = other["batches"]
            wait_until(lambda: daemon.status()["devices"][0]["workers"][1]["batches"] > after, 30,
                       message="the surviving feeder answered nothing after its sibling died")
            assert all(f.result(timeout=60).output is not None for f in futures)   # nothing lost

            def back():
                w = daemon.status()["devices"][0]["workers"][0]
                return w["state"] == "ready" and w["pid"] != victim["pid"] and w
            revived = wait_until(back, 30, message="the killed feeder did not come back")
            assert revived["restarts"] == 1
            assert client.submit("sim", "after", deadline_ms=60_000).result(timeout=30).output is not None
        assert daemon.status()["devices"][0]["state"] == "ready"
    finally:
        daemon.stop()
