"""The worker sockets' directory: a daemon killed outright leaves it behind, the next daemon to
start removes it, and a running daemon's directory is never touched (dynbatchd.ipcfiles)."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile

from conftest import SIMULATED, start_daemon
from dynbatchd.ipcfiles import WorkerSocketDir

HOLDER = ("import sys; from dynbatchd.ipcfiles import WorkerSocketDir; d = WorkerSocketDir(sys.argv[1]); "
          "print(d.path, flush=True); sys.stdin.read()")


def hold(base) -> tuple[subprocess.Popen, str]:
    """A process that made its directory under `base` and holds it until its stdin closes or it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(base)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_a_killed_daemons_directory_goes_at_the_next_start_and_a_running_ones_stays(tmp_path):
    killed, killed_dir = hold(tmp_path)
    running, running_dir = hold(tmp_path)
    try:
        with open(os.path.join(killed_dir, "workers.sock"), "w"):   # what the killed one left inside
            pass
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        (tmp_path / "dynbatchd-0").mkdir()   # the default control-socket directory: not a worker one
        assert os.path.isdir(killed_dir)

        fresh = WorkerSocketDir(str(tmp_path))
        assert not os.path.exists(killed_dir)
        assert os.path.isdir(running_dir)
        assert (tmp_path / "dynbatchd-0").is_dir()
        assert os.path.basename(fresh.path).startswith(f"{WorkerSocketDir.PREFIX}{os.getpid()}-")
        assert os.stat(fresh.path).st_mode & 0o777 == 0o700
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            ["dynbatchd-0", os.path.basename(running_dir), os.path.basename(fresh.path)])

        fresh.remove()   # the clean stop
        assert not os.path.exists(fresh.path)
    finally:
        running.stdin.close()
        running.wait()
    WorkerSocketDir(str(tmp_path)).remove()   # its holder has exited: now it is stale too
    assert not os.path.exists(running_dir)


def workers_dir_of(pid: int) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"{WorkerSocketDir.PREFIX}{pid}-*"))


def test_a_daemon_starting_removes_the_directory_a_killed_daemon_left_and_its_own_at_a_clean_stop(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    killed = start_daemon(tmp_path / "a", SIMULATED)
    left = workers_dir_of(killed.proc.pid)
    assert len(left) == 1
    killed.proc.kill()
    killed.proc.wait(30)
    assert os.path.isdir(left[0])
    second = start_daemon(tmp_path / "b", SIMULATED)
    try:
        assert not os.path.exists(left[0])
        assert len(workers_dir_of(second.proc.pid)) == 1
    finally:
        code = second.stop()
    assert code == 0 and workers_dir_of(second.proc.pid) == []
