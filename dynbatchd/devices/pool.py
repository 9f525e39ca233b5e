"""Start, feed and supervise the worker processes of each device (its feeders).

Each device is fed by `feeders` worker processes ([devices] workers_per_device),
so one process's CPU work (decoding, tokenising, copying back) overlaps
another's batch on the device. Workers connect to one ROUTER socket on an
ipc:// endpoint. The pool knows processes and messages, not scheduling: the
engine decides which batch goes to which device and feeder; the pool sends
it, hands results back (`on_result`), and reports a feeder that died
(`on_lost`) or came up (`on_ready`), and a device given up (`on_gone`).
Workers are numbered device by device (worker = device x feeders + feeder):
`send`, `kill` and those callbacks name a worker by that number, `on_gone`
and `describe` a device; with one feeder a device the two are the same, as
in a RayDevicePool.

Restarts are budgeted per feeder: each worker process has its own
`RestartBudget`, so a feeder that keeps dying is given up (and probed) while
the device's other feeders keep serving; the device itself is given up only
when every feeder of it is.

Restarts are budgeted in time (`RestartBudget`): a device is given up only
after more than `restart_limit` unexplained deaths within RESTART_WINDOW_S,
and the back-off before a restart (0.25 s, doubling, at most 30 s) follows
the same recent count, so both reset after healthy service. A given-up device
is probed (its worker started again) after `probe_after_s`, then ever more
rarely while probes die, and serves again as soon as one comes up. A death the engine explains (a
poison input proven by dying twice, alone the second time) costs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from dynbatchd import protocol as P
from dynbatchd.devices.restarts import PROBE_MAX_S, RESTART_WINDOW_S, Restart, RestartBudget  # noqa: F401 (named here too)
from dynbatchd.devices.runners import DEVICE_LOCKS_ENV
from dynbatchd.transport import LoopSocket

log = logging.getLogger(__name__)

@dataclass
class Worker:
    index: int                                          # device x feeders + feeder
    name: str
    device: str
    device_index: int = 0                               # the engine's index of its device
    feeder: int = 0                                     # which of the device's worker processes
    proc: asyncio.subprocess.Process | None = None
    state: str = "starting"
    failure: str = ""
    simulated: bool = False
    restarts: int = 0                                   # lifetime, for status and metrics
    budget: RestartBudget | None = None
    batches: int = 0                                    # results it sent back (lifetime, for status)
    sent: int = 0                                       # batches sent to its current process...
    answered: int = 0                                   # ...and answered by it: in flight is the difference
    models: tuple[str, ...] = ()                        # what its process said it has loaded (Ready)
    asked: tuple[str, ...] = ()                         # the models of the last Setup sent to it
    unanswered: int = 0                                 # Setups sent to its process not yet answered by a Ready
    load_failures: dict[str, str] = field(default_factory=dict)   # its last Ready's models it could not load

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "feeder": self.feeder, "pid": self.proc.pid if self.proc else 0,
                "state": self.state, "restarts": self.restarts, "batches": self.batches,
                "inflight": self.sent - self.answered}


def detect_devices(use: str | list[str]) -> list[str]:
    """`auto`: every GPU NVML can see (limited by CUDA_VISIBLE_DEVICES), or the CPU where there is none."""
    if isinstance(use, list):
        return list(use)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:  # torch numbers the visible GPUs cuda:0.. in this order
        count = len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
        return [f"cuda:{i}" for i in range(count)] or ["cpu"]
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
        if count:
            return [f"cuda:{i}" for i in range(count)]
    except Exception:
        pass
    return ["cpu"]


def end_leftovers(pid: int) -> None:
    """SIGKILL what a dead worker (`pid`, leader of its own session and process group) left behind: a process its model
    forked would keep the worker's sockets and device memory for as long as it runs."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass   # nothing left (a group with no process has no id)


class DevicePool:
    def __init__(self, ctx: zmq.Context, devices: list[str], models: list[P.ModelSpec], *,
                 cpu_threads: int, ipc_dir: str, restart_limit: int, probe_after_s: float = 30.0,
                 on_result: Callable[[int, P.BatchResult, list[bytes]], None],
                 on_lost: Callable[[int], bool], on_ready: Callable[[int], None],
                 on_gone: Callable[[int], None], on_read_done: Callable[[], None] = lambda: None,
                 log_level: str = "info", feeders: int = 1, log_format: str = "text"):
        self.models = models
        self.cpu_threads = cpu_threads
        self.on_result, self.on_lost, self.on_ready, self.on_gone = on_result, on_lost, on_ready, on_gone
        self.on_read_done = on_read_done   # after each pass over the results read at once
        self.on_generation: Callable[[int, Any], None] = lambda worker, msg: None   # GenTokens / GenEnd
        self.log_level, self.log_format = log_level, log_format   # workers log as the daemon does
        self.endpoint = f"ipc://{ipc_dir}/workers.sock"
        self.ipc_dir = ipc_dir
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A worker's replacement takes over its name even while the old connection lingers (a
        # process the worker forked keeps its socket open): without it the new worker's Hello was
        # dropped and the device stayed `starting` for good.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.bind(self.endpoint)
        self.io = LoopSocket(sock, self._on_messages)
        # by device, then feeder; named w0-cpu with one feeder a device, else w0.0-cpu, w0.1-cpu...
        self.feeders = [[Worker(i * feeders + f, f"w{i}-{d}" if feeders == 1 else f"w{i}.{f}-{d}", d, i, f,
                                budget=RestartBudget(restart_limit, probe_s=probe_after_s)) for f in range(feeders)]
                        for i, d in enumerate(devices)]
        self.workers = [w for device in self.feeders for w in device]
        self._by_name = {w.name.encode(): w for w in self.workers}
        self._ready = asyncio.Event()
        self._closing = False
        self._tasks: set[asyncio.Task] = set()   # the supervising tasks not yet ended (`_supervised`)

    # -- lifecycle ----------------------------------------------------------
    async def start(self, timeout_s: float) -> None:
        self.io.start(asyncio.get_running_loop())
        for worker in self.workers:
            await self._spawn(worker)
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(f"workers not ready after {timeout_s:g} s") from None
        failed = [w for w in self.workers if w.failure]
        if failed:
            raise RuntimeError("; ".join(f"{w.name}: {w.failure}" for w in failed))

    async def _spawn(self, worker: Worker) -> None:
        """Start `worker`'s process. Its stdout goes nowhere: nothing of the worker's own speaks there
        (its log lines go to stderr, the daemon's log), and a model that printed its inputs put
        payloads in the log. Its stderr stays the daemon's: log lines, tracebacks, native libraries' errors
        (what Python code writes there is counted, not written: `dynbatchd.logs.withhold_stderr`)."""
        worker.state = "starting"
        worker.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dynbatchd.devices.worker", "--endpoint", self.endpoint,
            "--name", worker.name, "--log-level", self.log_level,
            "--log-format", self.log_format, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, DEVICE_LOCKS_ENV: self.ipc_dir})   # feeders of a simulated device take turns
        task = asyncio.ensure_future(self._supervise(worker, worker.proc))
        self._tasks.add(task)
        task.add_done_callback(self._supervised)

    def _supervised(self, task: asyncio.Task) -> None:
        """A supervising task ended (its worker was started again by a new one, or the pool stops):
        forget it, else each restart of a worker kept one for good. A failure is logged, not kept."""
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("supervising a worker failed: %s: %s", type(exc).__name__, exc)

    async def _supervise(self, worker: Worker, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        end_leftovers(proc.pid)
        if self._closing or proc is not worker.proc:
            return
        # Results it sent just before dying may still be on their way through the socket:
        # collect them first, so only what was really unanswered counts as lost.
        await asyncio.sleep(0.1)
        self.io.drain_now()
        worker.state = "restarting"
        log.error("worker %s (pid %d) exited with %s", worker.name, proc.pid, code)
        explained = self.on_lost(worker.index)
        worker.sent = worker.answered = 0   # what it held is the engine's again
        if not self._ready.is_set() and worker.failure:
            self._ready.set()
            return
        restart = worker.budget.died(asyncio.get_running_loop().time(), explained)
        if restart.given_up:
            worker.state = "failed"
            gone = all(w.state == "failed" for w in self.feeders[worker.device_index])
            log.error("worker %s died %d times in %g s; giving up on %s, probing it again in %g s", worker.name,
                      len(worker.budget.deaths), worker.budget.window_s,
                      f"device {worker.device}" if gone else "it (its device's other workers serve)", restart.delay_s)
            if gone:
                self.on_gone(worker.device_index)
        worker.restarts += 1
        await asyncio.sleep(restart.delay_s)
        if not self._closing:
            if restart.given_up:
                log.info("probing device %s: starting worker %s again", worker.device, worker.name)
            await self._spawn(worker)

    async def stop(self, timeout_s: float = 10.0) -> None:
        self._closing = True
        procs = [w.proc for w in self.workers if w.proc and w.proc.returncode is None]
        for proc in procs:
            proc.terminate()
        if procs:
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=timeout_s)
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
                end_leftovers(proc.pid)
        for task in list(self._tasks):
            task.cancel()
        self.io.stop()
        self.io.sock.close(0)

    def kill(self, index: int, why: str) -> None:
        """Replace worker `index` (hung on a batch): supervision restarts it, the engine hears it lost."""
        worker = self.workers[index]
        if worker.proc is not None and worker.proc.returncode is None:
            log.error("worker %s %s; killing it", worker.name, why)
            worker.proc.kill()

    # -- feeding ------------------------------------------------------------
    def send(self, index: int, frames: list[Any]) -> bool:
        """Send an encoded batch to worker `index`; False when it vanished meanwhile."""
        worker = self.workers[index]
        try:
            self.io.sock.send_multipart([worker.name.encode(), *frames], copy=False)
        except zmq.ZMQError:
            return False
        finally:
            self.io.kick()
        worker.sent += 1
        return True

    # -- models a reload adds or removes --------------------------------------
    def set_models(self, models: list[P.ModelSpec]) -> None:
        """Have every worker hold `models`: each running process loads the new ones and drops the
        rest, then says Ready again (`on_ready`); a process started later gets them in its Setup.
        Chosen over rolling replacement of the processes because a running worker's batches, its
        restart budget and its place in the engine's device table stay untouched: a reload costs
        no process and no in-flight batch."""
        self.models = list(models)
        for worker in self.workers:
            if worker.state == "ready":   # one still loading gets it when it says Ready
                self._setup(worker)

    def _setup(self, worker: Worker) -> None:
        worker.asked = tuple(m.name for m in self.models)
        worker.unanswered += 1
        self.io.send([worker.name.encode(), P.encoder.encode(P.Setup(worker.device, self.models, self.cpu_threads))])

    def loaded(self, model: str) -> bool:
        """Whether some worker that serves has `model` loaded."""
        return any(w.state == "ready" and model in w.models for w in self.workers)

    # -- worker messages ----------------------------------------------------
    def _on_messages(self, batch: list[list[bytes]]) -> None:
        for frames in batch:
            worker = self._by_name.get(frames[0])
            if worker is None or len(frames) < 2:
                continue
            try:
                msg = P.worker_decoder.decode(frames[1])
            except Exception:
                # The batch it answered is unknown: the hung-batch watchdog will replace the worker.
                log.error("undecodable message from worker %s", worker.name)
                continue
            if isinstance(msg, P.BatchResult):
                worker.batches += 1
                worker.answered += 1
                self.on_result(worker.index, msg, frames[2:])
            elif isinstance(msg, (P.GenTokens, P.GenEnd)):
                self.on_generation(worker.index, msg)
            elif isinstance(msg, P.Hello):
                worker.unanswered = 0   # a new process: nothing was sent to it yet
                self._setup(worker)
            elif isinstance(msg, P.Ready):
                reloaded = worker.state == "ready"
                worker.state, worker.failure = "ready", ""
                worker.simulated, worker.models = bool(msg.simulated), tuple(msg.models)
                worker.unanswered, worker.load_failures = max(0, worker.unanswered - 1), dict(msg.failed)
                log.info("worker %s %s on %s (pid %d): %s", worker.name, "reloaded" if reloaded else "ready",
                         msg.device, msg.pid, ", ".join(msg.models))
                self._check_all_ready()
                self.on_ready(worker.index)
                if worker.asked != tuple(m.name for m in self.models):   # a reload came while it loaded
                    self._setup(worker)
            elif isinstance(msg, P.Failed):
                worker.failure = msg.message
                worker.state = "failed"
                log.error("worker %s failed to start: %s", worker.name, msg.message)
                self._check_all_ready()
        self.on_read_done()

    def _check_all_ready(self) -> None:
        if all(w.state == "ready" or w.failure for w in self.workers):
            self._ready.set()

    def describe(self, index: int) -> dict[str, Any]:
        """What status shows of device `index` beside the engine's counters: its first feeder's
        name and pid (with one feeder a device, its worker's), its state (ready while any feeder
        is), and each feeder under `workers`."""
        feeders = self.feeders[index]
        states = {w.state for w in feeders}
        state = next((s for s in ("ready", "starting", "restarting") if s in states), "failed")
        first = feeders[0]
        return {"name": first.name, "index": index, "pid": first.proc.pid if first.proc else 0, "state": state,
                "restarts": sum(w.restarts for w in feeders), "simulated": any(w.simulated for w in feeders),
                "workers": [w.describe() for w in feeders]}


# -- the device kind a config asks for -------------------------------------
def device_names(settings: Any) -> list[str]:
    """The engine's device names for `[devices]`: local devices, or Ray actors."""
    if getattr(settings, "ray", None) is not None:
        return settings.ray.device_names()
    return detect_devices(settings.use)


def pool_class(settings: Any) -> Callable[..., Any]:
    """What builds the pool for `[devices]`: DevicePool, or a RayDevicePool with the `[devices] ray` settings."""
    if getattr(settings, "ray", None) is not None:
        import functools

        from dynbatchd.devices.ray_pool import RayDevicePool

        return functools.partial(RayDevicePool, ray=settings.ray)
    return DevicePool
