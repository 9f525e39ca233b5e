"""What the benchmarks add to the daemon launcher: configs written from dicts, a daemon in a temporary
directory (`RunningDaemon`), the machine's own busy time, and CPU per request.

The launcher itself (`Daemon`, `wait_until`, `free_port`) lives in tests/launcher.py, with the
tests that must not import the benchmarks; it is re-exported here for the benchmarks.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import psutil

TESTS = Path(__file__).resolve().parent.parent / "tests"
if str(TESTS) not in sys.path:   # the launcher lives with the tests (a top-level module there, as helpers)
    sys.path.insert(0, str(TESTS))

from launcher import (REPO, TROUBLE, CpuSample, Daemon, WaitTimeout, dynbatchd_command, free_port,  # noqa: E402,F401
                      vm_rss_bytes, wait_until)

def ipc_daemon(directory: str | os.PathLike, config_body: Callable[[str, str], str], **kw: Any) -> Daemon:
    """A Daemon whose config lives in `directory`, with ipc:// sockets req.sock and ctl.sock there:
    `config_body(endpoint, control)` returns the config's text."""
    directory = Path(directory)
    endpoint, control = f"ipc://{directory}/req.sock", f"ipc://{directory}/ctl.sock"
    return Daemon(directory / "dynbatchd.toml", endpoint, control, config_text=config_body(endpoint, control), **kw)


# ---------------------------------------------------------------------------
# the benchmarks' one-channel daemon
# ---------------------------------------------------------------------------

def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def config_text(sock_dir: str, models: dict[str, dict[str, Any]], channel: dict[str, Any], *,
                inflight: int = 2, cpu_threads: int = 0, log_level: str = "warning", workers_per_device: int = 1,
                use: tuple[str, ...] = ("cpu",)) -> str:
    """A one-channel config: every request lands in channel `bench`."""
    lines = ["[daemon]", f'listen = "ipc://{sock_dir}/req.sock"', f'control = "ipc://{sock_dir}/ctl.sock"',
             f'log_level = "{log_level}"', "drain_timeout_s = 10.0", "",
             "[devices]", f"use = {toml_value(list(use))}", f"inflight = {inflight}", f"cpu_threads = {cpu_threads}",
             f"workers_per_device = {workers_per_device}", ""]
    for name, model in models.items():
        lines += [f"[models.{name}]"] + [f"{k} = {toml_value(v)}" for k, v in model.items()] + [""]
    lines += ["[channels.bench]"] + [f"{k} = {toml_value(v)}" for k, v in channel.items()] + [""]
    lines += ["[routing]", 'default = "bench"', ""]
    return "\n".join(lines)


class RunningDaemon(Daemon):
    """`with RunningDaemon(name, models, channel) as d:` -> d.endpoint, d.pid, d.cpu(), d.status().

    A one-channel benchmark daemon (`config_text`) in a fresh temporary directory; `cleanup()`
    removes the directory once the figures are read."""

    def __init__(self, name: str, models: dict[str, dict[str, Any]], channel: dict[str, Any], *,
                 inflight: int = 2, cpu_threads: int = 0, start_timeout_s: float = 300.0,
                 profile_to: str | None = None, workers_per_device: int = 1, use: tuple[str, ...] = ("cpu",)):
        self.dir = tempfile.mkdtemp(prefix=f"dynbatchd-bench-{name}-")
        self.config_path = os.path.join(self.dir, "dynbatchd.toml")
        self.log_path = os.path.join(self.dir, "daemon.log")
        self.start_timeout_s = start_timeout_s
        super().__init__(self.config_path, f"ipc://{self.dir}/req.sock", f"ipc://{self.dir}/ctl.sock",
                         config_text=config_text(self.dir, models, channel, inflight=inflight,
                                                 cpu_threads=cpu_threads, workers_per_device=workers_per_device,
                                                 use=use),
                         log=self.log_path, profile_to=profile_to, name=f"dynbatchd ({name})")

    def __enter__(self) -> "RunningDaemon":
        self.start(self.start_timeout_s)
        return self

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------------
# the machine
# ---------------------------------------------------------------------------

def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (every core, every process)."""
    t = psutil.cpu_times()
    return sum(getattr(t, f) for f in t._fields if f not in ("idle", "iowait", "guest", "guest_nice"))


def wait_for_quiet(max_wait_s: float, busy_cores: float = 0.3, sample_s: float = 0.5) -> float:
    """Wait (at most `max_wait_s`) until the machine is nearly idle; returns the last busy figure in cores.

    Called between runs, when the benchmark's own daemon is idle: whatever is busy then is
    someone else's load, which would make the next run's figures noisy.
    """
    deadline = time.monotonic() + max_wait_s
    while True:
        b0, t0 = machine_busy_s(), time.monotonic()
        time.sleep(sample_s)
        busy = (machine_busy_s() - b0) / (time.monotonic() - t0)
        if busy <= busy_cores or time.monotonic() >= deadline:
            return round(busy, 3)


def cpu_delta(before: CpuSample, after: CpuSample, requests: int) -> dict[str, Any]:
    """CPU spent between two samples, in total and in microseconds per request."""
    daemon = after.daemon_s - before.daemon_s
    workers = after.workers_s - before.workers_s
    wall = after.at - before.at
    per = (lambda s: round(s * 1e6 / requests, 1)) if requests else (lambda s: None)
    return {
        "wall_s": round(wall, 3),
        "daemon_cpu_s": round(daemon, 3), "workers_cpu_s": round(workers, 3),
        "daemon_us_per_req": per(daemon), "workers_us_per_req": per(workers),
        "total_us_per_req": per(daemon + workers),
        "daemon_cores": round(daemon / wall, 3) if wall > 0 else None,
        "workers_cores": round(workers / wall, 3) if wall > 0 else None,
        "worker_pids_changed": before.worker_pids != after.worker_pids,
        "daemon_rss_mb": round(after.daemon_rss / 1e6, 1),
        "daemon_rss_growth_kb_per_1k_req": round((after.daemon_rss - before.daemon_rss) / 1e3 / requests * 1000, 1)
        if requests else None,
        "clock_tick_s": 1.0 / os.sysconf("SC_CLK_TCK"),
    }
