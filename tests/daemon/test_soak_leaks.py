"""What a leak hunt (a live daemon under minutes of mixed traffic, reloads and tunes) found growing
without bound, each checked here on the structure that grew, in seconds, without a daemon.

- The local device pool kept every supervising task it ever started: one more per worker start,
  so a worker that kept dying (a crash-looping model, a given-up device probed for days) grew the
  daemon by a finished task per restart, for good. A finished one is now forgotten.
"""

from __future__ import annotations

import asyncio
import itertools

import zmq

from dynbatchd.devices import pool as poolmod
from dynbatchd.devices.pool import DevicePool
from dynbatchd.devices.restarts import Restart

_pids = itertools.count(4_000_000)


class _DyingProcess:
    """A worker process that has exited by the time anyone waits for it."""

    def __init__(self) -> None:
        self.pid = next(_pids)
        self.returncode: int | None = None

    async def wait(self) -> int:
        self.returncode = 3
        return 3

    def terminate(self) -> None:
        pass

    def kill(self) -> None:
        pass


class _NoBackoff:
    """A restart budget that restarts at once and never gives up (the test is about bookkeeping)."""
    deaths: tuple = ()
    window_s = 60.0

    def died(self, now_s: float, explained: bool = False) -> Restart:
        return Restart(0.0, False)


def test_worker_restarts_leave_no_finished_supervising_task_behind(tmp_path, monkeypatch):
    restarts = 12
    spawned: list[_DyingProcess] = []

    async def start_process(*args, **kwargs):
        spawned.append(proc := _DyingProcess())
        return proc

    # no real process: nothing to signal (end_leftovers would SIGKILL a process group by pid)
    monkeypatch.setattr(poolmod.asyncio, "create_subprocess_exec", start_process)
    monkeypatch.setattr(poolmod, "end_leftovers", lambda pid: None)

    async def run() -> int:
        pool = DevicePool(zmq.Context.instance(), ["cpu"], [], cpu_threads=0, ipc_dir=str(tmp_path),
                          restart_limit=1000, on_result=lambda *a: None, on_lost=lambda device: False,
                          on_ready=lambda device: None, on_gone=lambda device: None)
        worker = pool.workers[0]
        worker.budget = _NoBackoff()
        try:
            await pool._spawn(worker)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while worker.restarts < restarts:   # each death: a supervising task ends, a new one starts
                assert loop.time() < deadline, f"only {worker.restarts} restarts"
                await asyncio.sleep(0.01)
            await asyncio.sleep(0)   # the done callbacks of the tasks that just ended
            return len(pool._tasks)
        finally:
            pool._closing = True
            for task in list(pool._tasks):
                task.cancel()
            pool.io.sock.close(0)

    kept = asyncio.run(run())
    assert len(spawned) >= restarts
    # the one supervising the running process, and at most the one that just started it
    assert kept <= 2, f"{kept} supervising tasks kept after {len(spawned)} worker starts"
