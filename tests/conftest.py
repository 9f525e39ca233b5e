"""Fixtures that run the real daemon in a subprocess over real (ipc://) sockets."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dynbatchd.client import DynbatchdError, control_call

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py for callable runners


class RunningDaemon:
    def __init__(self, proc: subprocess.Popen, endpoint: str, control: str, config: Path, log: Path):
        self.proc, self.endpoint, self.control, self.config, self.log = proc, endpoint, control, config, log

    def call(self, cmd: str, **args):
        return control_call(self.control, cmd, **args)

    def status(self) -> dict:
        return self.call("status")

    def logs(self) -> str:
        return self.log.read_text()

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_daemon(tmp: Path, body: str, *, ready_timeout: float = 180, daemon_extra: str = "",
                 devices_extra: str = "") -> RunningDaemon:
    """Write a config (endpoints in `tmp`) plus `body`, start dynbatchd, wait until it serves."""
    endpoint, control = f"ipc://{tmp}/req.sock", f"ipc://{tmp}/ctl.sock"
    config = tmp / "dynbatchd.toml"
    config.write_text(textwrap.dedent(f"""
        [daemon]
        listen = "{endpoint}"
        control = "{control}"
        drain_timeout_s = 20
        {daemon_extra}
        [devices]
        use = ["cpu"]
        cpu_threads = 2
        {devices_extra}
    """) + textwrap.dedent(body))
    log = tmp / "daemon.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).resolve().parent)}
    proc = subprocess.Popen([sys.executable, "-m", "dynbatchd", "start", "--config", str(config)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=REPO)
    daemon = RunningDaemon(proc, endpoint, control, config, log)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}:\n{daemon.logs()}")
        try:
            if control_call(control, "ping", timeout_s=1)["state"] == "serving":
                return daemon
        except DynbatchdError:
            pass  # not bound yet; control_call itself waited up to a second
    proc.kill()
    raise RuntimeError(f"daemon not serving after {ready_timeout} s:\n{daemon.logs()}")


SIMULATED = """
    [models.sim]
    runner = "simulated"
    options = { base_ms = 2.0, per_item_ms = 0.1 }
    [models.echo]
    runner = "callable"
    options = { target = "helpers:echo_or_fail" }
    [channels.standard]
    max_batch = 16
    window_ms = 5
    deadline_ms = 5000
    queue_limit = 4096
    [channels.realtime]
    max_batch = 8
    window_ms = 1
    deadline_ms = 1000
    [channels.vault]
    max_batch = 8
    window_ms = 5
    isolated = true
    [routing]
    default = "standard"
    [[routing.rules]]
    tag = "urgent"
    channel = "realtime"
    [[routing.rules]]
    tag = "banking"
    channel = "vault"
"""

MINILM = """
    [models.minilm]
    runner = "sentence-embedding"
    [channels.standard]
    max_batch = 32
    window_ms = 20
    deadline_ms = 60000
    queue_limit = 8192
    [routing]
    default = "standard"
"""


@pytest.fixture(scope="session")
def sim_daemon(tmp_path_factory):
    port = free_port()
    daemon = start_daemon(tmp_path_factory.mktemp("sim"), SIMULATED,
                          daemon_extra=f'metrics_listen = "127.0.0.1:{port}"')
    daemon.metrics_url = f"http://127.0.0.1:{port}/metrics"
    yield daemon
    daemon.stop()


@pytest.fixture(scope="session")
def minilm_daemon(tmp_path_factory):
    daemon = start_daemon(tmp_path_factory.mktemp("minilm"), MINILM)
    yield daemon
    daemon.stop()
