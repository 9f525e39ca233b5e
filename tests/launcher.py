"""Start a real `dynbatchd`, wait until it serves, watch its CPU time and memory, stop it, read its log.

The one launcher for every daemon a test or a benchmark runs: `Daemon` starts
`dynbatchd start --config FILE` (foreground, exactly as an operator runs it) from a config
written by the caller, and `wait_until` is the bounded, pausing poll that waits for it (and
for anything else). It lives with the tests, which must not import the benchmarks; the
benchmarks import it from here (benchmarks/harness.py). tests/conftest.py's `start_daemon`
and the benchmarks' `RunningDaemon` are thin layers over it. CPU time comes from /proc
(utime + stime of every thread) for the daemon process and, separately, for all of its
descendants (the device workers); memory is the daemon's resident set (VmRSS).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

import psutil

from dynbatchd.client import DynbatchdError, control_call

REPO = Path(__file__).resolve().parent.parent

# Log lines that mean the daemon lost or refused work it should not have.
TROUBLE = ("reply dropped", "exited with", "undecodable", "failed a batch", "Traceback", "died", "ERROR")

T = TypeVar("T")


class WaitTimeout(AssertionError, TimeoutError):
    """`wait_until` ran out of time: an assertion failure in a test, a TimeoutError elsewhere."""


def wait_until(predicate: Callable[[], T], timeout_s: float, interval_s: float = 0.05, *,
               message: str | Callable[[], str] = "condition not met") -> T:
    """Call `predicate` until it returns something truthy (returned), pausing `interval_s` between
    calls; raise WaitTimeout(`message`) once `timeout_s` has passed. Always checks at least once,
    and once more at the deadline, so a slow predicate cannot make it give up early."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            text = message() if callable(message) else message
            raise WaitTimeout(f"{text} (after {timeout_s:g} s)")
        time.sleep(min(interval_s, left))


def dynbatchd_command() -> list[str]:
    """The installed `dynbatchd` script beside this interpreter (as `make run` starts it)."""
    script = Path(sys.executable).parent / "dynbatchd"
    if script.exists():
        return [str(script)]
    found = shutil.which("dynbatchd")
    if found:
        return [found]
    return [sys.executable, "-m", "dynbatchd"]


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


@dataclass
class CpuSample:
    """Cumulative CPU seconds (user + system, all threads) at one moment."""
    at: float
    daemon_s: float
    workers_s: float
    worker_pids: tuple[int, ...]
    daemon_rss: int = 0   # bytes resident, the daemon process only


def vm_rss_bytes(pid: int) -> int:
    """VmRSS of `pid` from /proc/PID/status, in bytes (0 where there is no such line)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Daemon:
    """One `dynbatchd start --config CONFIG` in a subprocess, its log in LOG.

    `config_text` is written to `config` first when given. `endpoint` and `control` are the
    request and control addresses the config binds (the caller wrote them). `env` adds to the
    environment (a value of None removes the variable), `pythonpath` goes before any
    PYTHONPATH already set, `wrap` goes before the command (e.g. a shell that sets WATCHDOG_PID)
    and `profile_to` runs the daemon under cProfile, its stats written there at exit.

        d = Daemon(config, endpoint, control, config_text=text).start()   # waits for ping: serving
        ...; d.stop()   # SIGTERM, drain, exit code
        with Daemon(...) as d: ...                                      # the same, stopped on exit
    """

    def __init__(self, config: str | os.PathLike, endpoint: str, control: str, *, config_text: str | None = None,
                 log: str | os.PathLike | None = None, env: Mapping[str, str | None] | None = None,
                 pythonpath: Sequence[str | os.PathLike] = (), wrap: Sequence[str] = (),
                 profile_to: str | None = None, name: str = "dynbatchd", cwd: str | os.PathLike = REPO):
        self.config = Path(config)
        self.endpoint, self.control = endpoint, control
        self.log = Path(log) if log is not None else self.config.with_name("daemon.log")
        self.name = name
        self.profile_to = profile_to
        self.wrap = list(wrap)
        self.cwd = cwd
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        for key, value in (env or {}).items():
            if value is None:
                self.env.pop(key, None)
            else:
                self.env[key] = value
        if pythonpath:
            self.env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath),
                                                      *filter(None, [self.env.get("PYTHONPATH")])])
        if config_text is not None:
            self.config.parent.mkdir(parents=True, exist_ok=True)
            self.config.write_text(config_text)
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.trouble: list[str] = []   # what the log and the exit said went wrong (filled by stop)
        self._log_file = None
        self._ps: psutil.Process | None = None

    # -- lifecycle ----------------------------------------------------------
    @property
    def command(self) -> list[str]:
        if self.profile_to:
            start = [sys.executable, "-c", PROFILE_SNIPPET, self.profile_to]
        else:
            start = dynbatchd_command()
        return [*self.wrap, *start, "start", "--config", str(self.config)]

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the daemon was never launched"
        return self.proc.pid

    def launch(self) -> "Daemon":
        """Start the process and return at once (`start` also waits until it serves)."""
        self._log_file = self.log.open("wb")
        self.proc = subprocess.Popen(self.command, stdout=self._log_file, stderr=subprocess.STDOUT, env=self.env,
                                     stdin=subprocess.DEVNULL, cwd=self.cwd)
        self._ps = psutil.Process(self.proc.pid)
        return self

    def start(self, timeout_s: float = 180.0) -> "Daemon":
        """Launch, then wait (at most `timeout_s`) until `ping` says serving; RuntimeError with the
        log if the daemon exits first or never gets there (it is stopped then)."""
        if self.proc is None:
            self.launch()

        def serving() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while starting:\n"
                                   + self.log_tail())
            try:
                return self.ping(timeout_s=1.0)["state"] == "serving"
            except DynbatchdError:
                return False   # not bound yet (the ping itself waited up to a second)
        try:
            wait_until(serving, timeout_s, 0.1, message=f"{self.name} not serving")
        except WaitTimeout:
            self.kill()
            raise RuntimeError(f"{self.name} not serving after {timeout_s:g} s:\n{self.log_tail()}") from None
        except BaseException:
            self.kill()
            raise
        return self

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (the daemon drains), wait at most `timeout` s; the exit code. A daemon still
        running then is killed and TimeoutExpired raised. Log trouble is collected in `trouble`."""
        if self.proc is None:
            return self.exit_code if self.exit_code is not None else 0
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.trouble.append(f"daemon did not stop within {timeout:g} s of SIGTERM; killed")
                self.kill()
                raise
            return self._finish()
        finally:
            if self.proc is not None and self.proc.poll() is not None:
                self._finish()

    def kill(self) -> None:
        """SIGKILL the daemon (its workers notice their parent is gone and leave)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None:
            self._finish()

    def _finish(self) -> int:
        if self.exit_code is None and self.proc is not None:
            self.exit_code = self.proc.returncode
            if self._log_file is not None:
                self._log_file.close()
            if self.exit_code != 0:
                self.trouble.append(f"daemon exit code {self.exit_code}")
            self.trouble += [line for line in self.log_lines() if any(t in line for t in TROUBLE)][:20]
        return self.exit_code

    def __enter__(self) -> "Daemon":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.stop(30)
        except subprocess.TimeoutExpired:
            pass   # killed, and said so in `trouble`

    # -- talking to it ------------------------------------------------------
    def call(self, cmd: str, timeout_s: float = 5.0, **args: Any) -> Any:
        return control_call(self.control, cmd, timeout_s=timeout_s, **args)

    def ping(self, timeout_s: float = 5.0) -> dict[str, Any]:
        return self.call("ping", timeout_s=timeout_s)

    def status(self) -> dict[str, Any]:
        return self.call("status")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def worker_pids(self) -> list[int]:
        """The device workers' pids as the daemon reports them (status, devices[i].pid)."""
        return [d["pid"] for d in self.status()["devices"]]

    # -- observation --------------------------------------------------------
    def rss(self) -> int:
        """The daemon's resident memory now, bytes (VmRSS)."""
        return vm_rss_bytes(self.pid)

    def cpu(self) -> CpuSample:
        """CPU seconds so far: the daemon process, and all its descendants together."""
        at = time.perf_counter()
        ps = self._ps
        t = ps.cpu_times()
        daemon = t.user + t.system
        workers, pids = 0.0, []
        for child in ps.children(recursive=True):
            try:
                ct = child.cpu_times()
            except psutil.NoSuchProcess:
                continue
            workers += ct.user + ct.system
            pids.append(child.pid)
        return CpuSample(at, daemon, workers, tuple(sorted(pids)), ps.memory_info().rss)

    def logs(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def log_lines(self) -> list[str]:
        return self.logs().splitlines()

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_lines()[-n:])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for the daemon's HTTP or metrics address)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
