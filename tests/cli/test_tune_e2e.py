"""`dynbatchctl tune --auto` against a live daemon on the simulated runner: under traffic its running
setting cannot carry, the loop promotes a better one through the real control socket, records it,
and `--rollback` restores the old one. (Predicted and canary figures are SIMULATED.)"""

from __future__ import annotations

import asyncio
import json
import threading
import time

from typer.testing import CliRunner

from conftest import start_daemon
from dynbatchd.cli import dynbatchctl as ctl
from dynbatchd.client import AsyncClient
from helpers import wait_until

BODY = """
    [models.sim]
    runner = "simulated"
    options = { base_ms = 8.0, per_item_ms = 0.5 }
    [channels.standard]
    max_batch = 2
    window_ms = 1
    deadline_ms = 300
    queue_limit = 4096
    [channels.realtime]
    max_batch = 8
    window_ms = 1
    deadline_ms = 1000
    [routing]
    default = "standard"
"""
RATE = 400          # requests/s offered; batches of 2 at 8 ms + 0.5 ms each carry ~220/s


def test_tune_auto_promotes_on_a_live_daemon_and_rollback_restores(tmp_path):
    daemon = start_daemon(tmp_path, BODY)
    stop = threading.Event()

    async def send() -> None:   # open-loop traffic at RATE while the loop observes and tunes
        async with AsyncClient(daemon.endpoint, timeout=5) as client:
            start, sent, pending = time.monotonic(), 0, set()
            while not stop.is_set():
                due = int((time.monotonic() - start) * RATE)
                for _ in range(due - sent):
                    task = asyncio.ensure_future(client.infer("sim", "x" * 40))
                    pending.add(task)
                    task.add_done_callback(lambda t: (pending.discard(t), t.exception()))
                sent = max(sent, due)
                await asyncio.sleep(0.002)
            await asyncio.gather(*pending, return_exceptions=True)

    def load() -> None:
        asyncio.run(send())

    sender = threading.Thread(target=load, daemon=True)
    sender.start()
    try:
        def observed() -> bool:
            c = daemon.status()["channels"]["standard"]
            return c["cost_ms"]["samples"] >= 20 and c["offered"] >= 200
        wait_until(observed, 60, message="the daemon never observed enough traffic")
        invoke = lambda *a: CliRunner().invoke(ctl.app, ["--control", daemon.control, "--config", str(daemon.config), *a])
        result = invoke("tune", "--auto", "standard", "--trials", "10", "--duration", "3", "--canary-seconds", "3",
                        "--window", "3", "--json")
        assert result.exit_code == 0, result.output
        report = json.loads(result.output)["channels"][0]
        assert report["outcome"] == "promoted", report
        running = daemon.call("config")["channels"]["standard"]
        assert running["max_batch"] == report["candidate"]["max_batch"] > 2
        drop_in = (tmp_path / "state" / "overrides.toml").read_text()   # the promotion persists
        assert 'source = "canary"' in drop_in and f"max_batch = {{ value = {running['max_batch']}," in drop_in
        assert daemon.status()["overrides"]["standard"]["max_batch"]["value"] == running["max_batch"]
        assert sum("canary of channel standard ended" in line for line in daemon.log_lines()) == 1
        history = json.loads(invoke("tune", "--history", "standard", "--json").output)
        assert [s["step"] for s in history] == ["proposal", "risk", "canary", "promote"]
        assert invoke("tune", "--rollback", "standard").exit_code == 0
        assert daemon.call("config")["channels"]["standard"]["max_batch"] == 2
    finally:
        stop.set()
        sender.join(10)
        daemon.stop()
