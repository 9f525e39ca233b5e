"""Start a real `dynbatchd` for a benchmark, watch its CPU time, stop it, and read its log.

The daemon runs exactly as an operator runs it (`dynbatchd start --config FILE`, foreground),
from a config file written into a temporary directory with ipc:// endpoints. CPU time comes
from /proc (utime + stime of every thread) for the daemon process and, separately, for all
of its descendants (the device workers).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from dynbatchd.client import DynbatchdError, control_call

# Log lines that mean the daemon lost or refused work it should not have.
TROUBLE = ("reply dropped", "exited with", "undecodable", "failed a batch", "Traceback", "died", "ERROR")


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
                inflight: int = 2, cpu_threads: int = 0, log_level: str = "warning") -> str:
    """A one-channel config: every request lands in channel `bench`."""
    lines = ["[daemon]", f'listen = "ipc://{sock_dir}/req.sock"', f'control = "ipc://{sock_dir}/ctl.sock"',
             f'log_level = "{log_level}"', "drain_timeout_s = 10.0", "",
             "[devices]", 'use = ["cpu"]', f"inflight = {inflight}", f"cpu_threads = {cpu_threads}", ""]
    for name, model in models.items():
        lines += [f"[models.{name}]"] + [f"{k} = {toml_value(v)}" for k, v in model.items()] + [""]
    lines += ["[channels.bench]"] + [f"{k} = {toml_value(v)}" for k, v in channel.items()] + [""]
    lines += ["[routing]", 'default = "bench"', ""]
    return "\n".join(lines)


# Runs the daemon's CLI under cProfile; the stats are written when it exits (after SIGTERM drains it).
PROFILE_SNIPPET = """
import cProfile, sys
from dynbatchd.cli.dynbatchd import app
out = sys.argv.pop(1)
prof = cProfile.Profile()
prof.enable()
try:
    app(sys.argv[1:], prog_name="dynbatchd")
except SystemExit:
    pass
finally:
    prof.disable()
    prof.dump_stats(out)
"""


def dynbatchd_command() -> list[str]:
    """The installed `dynbatchd` script beside this interpreter (as `make run` starts it)."""
    script = Path(sys.executable).parent / "dynbatchd"
    if script.exists():
        return [str(script)]
    found = shutil.which("dynbatchd")
    if found:
        return [found]
    return [sys.executable, "-c", "from dynbatchd.cli.dynbatchd import main; main()"]


@dataclass
class CpuSample:
    """Cumulative CPU seconds (user + system, all threads) at one moment."""
    at: float
    daemon_s: float
    workers_s: float
    worker_pids: tuple[int, ...]
    daemon_rss: int = 0   # bytes resident, the daemon process only


class RunningDaemon:
    """`with RunningDaemon(name, models, channel) as d:` -> d.endpoint, d.pid, d.cpu(), d.status()."""

    def __init__(self, name: str, models: dict[str, dict[str, Any]], channel: dict[str, Any], *,
                 inflight: int = 2, cpu_threads: int = 0, start_timeout_s: float = 300.0,
                 profile_to: str | None = None):
        self.name = name
        self.profile_to = profile_to
        self.dir = tempfile.mkdtemp(prefix=f"dynbatchd-bench-{name}-")
        self.config_path = os.path.join(self.dir, "dynbatchd.toml")
        self.log_path = os.path.join(self.dir, "daemon.log")
        Path(self.config_path).write_text(config_text(self.dir, models, channel, inflight=inflight,
                                                      cpu_threads=cpu_threads))
        self.endpoint = f"ipc://{self.dir}/req.sock"
        self.control = f"ipc://{self.dir}/ctl.sock"
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.trouble: list[str] = []

    @property
    def command(self) -> list[str]:
        if self.profile_to:
            return [sys.executable, "-c", PROFILE_SNIPPET, self.profile_to, "start", "--config", self.config_path]
        return [*dynbatchd_command(), "start", "--config", self.config_path]

    def __enter__(self) -> "RunningDaemon":
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dynbatchd ({self.name}) exited with {self.proc.returncode} while starting:\n"
                                   + self.log_tail())
            try:
                if control_call(self.control, "ping", timeout_s=1.0)["state"] == "serving":
                    break
            except DynbatchdError:
                pass
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"dynbatchd ({self.name}) not serving after {self.start_timeout_s:g} s:\n"
                                   + self.log_tail())
            time.sleep(0.1)
        self.pid = self.proc.pid
        self._ps = psutil.Process(self.pid)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
                self.trouble.append("daemon did not stop within 30 s of SIGTERM; killed")
        self.exit_code = self.proc.returncode
        self._log.close()
        if self.exit_code != 0:
            self.trouble.append(f"daemon exit code {self.exit_code}")
        self.trouble += [line for line in self.log_lines() if any(t in line for t in TROUBLE)][:20]
        self.proc = None

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- observation --------------------------------------------------------
    def cpu(self) -> CpuSample:
        """CPU seconds so far: the daemon process, and all its descendants together."""
        at = time.perf_counter()
        t = self._ps.cpu_times()
        daemon = t.user + t.system
        workers, pids = 0.0, []
        for child in self._ps.children(recursive=True):
            try:
                ct = child.cpu_times()
            except psutil.NoSuchProcess:
                continue
            workers += ct.user + ct.system
            pids.append(child.pid)
        return CpuSample(at, daemon, workers, tuple(sorted(pids)), self._ps.memory_info().rss)

    def status(self) -> dict[str, Any]:
        return control_call(self.control, "status", timeout_s=5.0)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_lines(self) -> list[str]:
        try:
            return Path(self.log_path).read_text(errors="replace").splitlines()
        except OSError:
            return []

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_lines()[-n:])


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
