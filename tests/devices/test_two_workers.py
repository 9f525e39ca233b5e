"""Two workers on the same device kind: told apart in status, and both take work under load."""

from __future__ import annotations

from conftest import SIMULATED, start_daemon

from dynbatchd.client import Client


def test_two_cpu_workers_are_named_apart_and_both_take_work(tmp_path):
    slow = SIMULATED.replace("base_ms = 2.0", "base_ms = 20.0")   # one device alone would queue
    daemon = start_daemon(tmp_path, slow, devices=("cpu", "cpu"), cpu_threads=1, devices_extra="inflight = 1")
    try:
        with Client(daemon.endpoint) as client:
            futures = [client.submit("sim", f"r{i}", deadline_ms=60_000) for i in range(400)]
            assert all(f.result(timeout=120).output is not None for f in futures)
        devices = daemon.status()["devices"]
        assert [(d["device"], d["index"]) for d in devices] == [("cpu", 0), ("cpu", 1)]
        assert len({d["name"] for d in devices}) == 2
        assert all(d["batches"] > 0 for d in devices), devices
    finally:
        daemon.stop()
