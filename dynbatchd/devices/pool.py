"""Start, feed and supervise one worker process per device.

Workers connect to one ROUTER socket on an ipc:// endpoint. Each may hold up
to `inflight` batches (one computing, the next already waiting) so the
device never idles while the daemon assembles work; the next batch is sent
only when the running one is due to end within `queue_lead_ns`
(`dynbatchd.scheduler.slots`), and to the worker that can start it soonest. A worker that dies is
restarted; the batches it held are handed back to the caller (`on_lost`),
split into the one it was running and those still waiting, to be requeued or
answered, never silently dropped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from dynbatchd import protocol as P
from dynbatchd.scheduler import Batch
from dynbatchd.scheduler.slots import DeviceView, estimated_free_at, pick_device
from dynbatchd.telemetry import DeviceStats
from dynbatchd.transport import LoopSocket

log = logging.getLogger(__name__)


@dataclass
class Worker:
    name: str
    device: str
    stats: DeviceStats
    proc: asyncio.subprocess.Process | None = None
    ready: bool = False
    inflight: dict[int, tuple[Batch, int]] = field(default_factory=dict)  # batch id -> (batch, sent_ns)
    failure: str = ""
    exclusive: bool = False   # running a retried batch alone: takes nothing else meanwhile


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


class DevicePool:
    def __init__(self, ctx: zmq.Context, devices: list[str], models: list[P.ModelSpec], *,
                 inflight: int, cpu_threads: int, ipc_dir: str, restart_limit: int, queue_lead_ns: int,
                 on_result: Callable[[Worker, Batch, P.BatchResult, list[bytes]], None],
                 on_lost: Callable[[Worker, list[Batch], list[Batch]], None],
                 on_capacity: Callable[[], None],
                 clock: Callable[[], int] = time.monotonic_ns, log_level: str = "info"):
        self.models = models
        self.inflight_limit = inflight
        self.queue_lead_ns = queue_lead_ns
        self.cpu_threads = cpu_threads
        self.restart_limit = restart_limit
        self.on_result = on_result
        self.on_lost = on_lost
        self.on_capacity = on_capacity
        self.clock = clock
        self.log_level = log_level
        self.endpoint = f"ipc://{ipc_dir}/workers.sock"
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.bind(self.endpoint)
        self.io = LoopSocket(sock, self._on_batch)
        now = clock()
        self.workers = {f"w{i}-{d}": Worker(f"w{i}-{d}", d, DeviceStats(d, since_ns=now))
                        for i, d in enumerate(devices)}
        self.memory_used = 0.0   # fullest GPU's memory use (0..1), as the observer last read it
        self._ready = asyncio.Event()
        self._closing = False
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle ----------------------------------------------------------
    async def start(self, timeout_s: float) -> None:
        self.io.start(asyncio.get_running_loop())
        for worker in self.workers.values():
            await self._spawn(worker)
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(f"workers not ready after {timeout_s:g} s") from None
        failed = [w for w in self.workers.values() if w.failure]
        if failed:
            raise RuntimeError("; ".join(f"{w.name}: {w.failure}" for w in failed))

    async def _spawn(self, worker: Worker) -> None:
        worker.ready = False
        worker.stats.state = "starting"
        worker.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dynbatchd.devices.worker", "--endpoint", self.endpoint,
            "--name", worker.name, "--log-level", self.log_level, stdin=asyncio.subprocess.DEVNULL)
        worker.stats.pid = worker.proc.pid
        self._tasks.append(asyncio.ensure_future(self._supervise(worker, worker.proc)))

    async def _supervise(self, worker: Worker, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if self._closing or proc is not worker.proc:
            return
        # Results it sent just before dying may still be on their way through the socket:
        # collect them first, so only what was really unanswered counts as lost.
        await asyncio.sleep(0.1)
        self.io.drain_now()
        lost = [b for b, _ in worker.inflight.values()]   # in the order sent: the first was running
        worker.inflight.clear()
        worker.exclusive = False
        worker.stats.inflight = 0
        worker.ready = False
        log.error("worker %s (pid %d) exited with %s; %d batches in flight", worker.name, proc.pid, code, len(lost))
        log.debug("lost batches: %s", [(b.id, [i.key for i in b.items]) for b in lost])
        if lost:
            self.on_lost(worker, lost[:1], lost[1:])
        if not self._ready.is_set() and worker.failure:
            self._ready.set()
            return
        if worker.stats.restarts >= self.restart_limit:
            worker.stats.state = "failed"
            log.error("worker %s restarted %d times; giving up on device %s", worker.name,
                      worker.stats.restarts, worker.device)
            return
        worker.stats.restarts += 1
        await asyncio.sleep(min(30.0, 0.25 * 2 ** (worker.stats.restarts - 1)))  # back off: 0.25 s, 0.5 s, 1 s...
        if not self._closing:
            await self._spawn(worker)

    async def stop(self, timeout_s: float = 10.0) -> None:
        self._closing = True
        procs = [w.proc for w in self.workers.values() if w.proc and w.proc.returncode is None]
        for proc in procs:
            proc.terminate()
        if procs:
            done, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=timeout_s)
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
        for task in self._tasks:
            task.cancel()
        self.io.stop()
        self.io.sock.close(0)

    # -- feeding ------------------------------------------------------------
    def views(self, now_ns: int, estimate: Callable[[Batch], int]) -> list[DeviceView]:
        """Each worker as the dispatcher sees it: batches held and when they should all be done."""
        return [DeviceView(len(w.inflight), estimated_free_at(w.inflight.values(), estimate),
                           w.ready and not w.exclusive) for w in self.workers.values()]

    def inflight(self) -> int:
        return sum(len(w.inflight) for w in self.workers.values())

    def dispatch(self, batch: Batch, frames: list[Any], now_ns: int, views: list[DeviceView],
                 estimate: Callable[[Batch], int]) -> bool:
        """Send an encoded batch to the worker that can start it soonest; `views` (from
        `views()`) is updated in place, so one snapshot serves a whole scheduling pass.

        A batch of a request that was running when a worker died goes only to an
        idle worker and runs there alone: if it kills that worker too, it is
        certainly the cause. Returns False when no worker can take it now.
        """
        exclusive = any(item.retries for item in batch.items)
        choose = [DeviceView(v.held, v.free_at_ns, v.usable and v.held == 0) for v in views] if exclusive else views
        index = pick_device(choose, now_ns, self.inflight_limit, self.queue_lead_ns)
        if index is None:
            return False
        worker = list(self.workers.values())[index]
        worker.inflight[batch.id] = (batch, now_ns)
        worker.exclusive = exclusive
        worker.stats.inflight = len(worker.inflight)
        view = views[index]
        views[index] = DeviceView(view.held + 1, max(view.free_at_ns, now_ns) + estimate(batch),
                                  view.usable and not exclusive)
        try:
            self.io.sock.send_multipart([worker.name.encode(), *frames], copy=False)
        except zmq.ZMQError:  # the worker vanished between its last message and now
            del worker.inflight[batch.id]
            worker.exclusive = False
            worker.stats.inflight = len(worker.inflight)
            views[index] = DeviceView(view.held, view.free_at_ns, False)
            self.on_lost(worker, [], [batch])
        self.io.kick()
        return True

    # -- worker messages ----------------------------------------------------
    def _on_batch(self, batch: list[list[bytes]]) -> None:
        for frames in batch:
            worker = self.workers.get(frames[0].decode(errors="replace"))
            if worker is None or len(frames) < 2:
                continue
            try:
                msg = P.worker_decoder.decode(frames[1])
            except Exception:
                # The batch it answered is unknown: the hung-batch watchdog will replace the worker.
                log.error("undecodable message from worker %s", worker.name)
                continue
            if isinstance(msg, P.BatchResult):
                self._on_result(worker, msg, frames[2:])
            elif isinstance(msg, P.Hello):
                setup = P.Setup(worker.device, self.models, self.cpu_threads)
                self.io.send([frames[0], P.encoder.encode(setup)])
            elif isinstance(msg, P.Ready):
                worker.ready = True
                worker.stats.state = "ready"
                worker.stats.simulated = bool(msg.simulated)
                log.info("worker %s ready on %s (pid %d): %s", worker.name, msg.device, msg.pid, ", ".join(msg.models))
                self._check_all_ready()
                self.on_capacity()
            elif isinstance(msg, P.Failed):
                worker.failure = msg.message
                worker.stats.state = "failed"
                log.error("worker %s failed to start: %s", worker.name, msg.message)
                self._check_all_ready()

    def replace_hung(self, now_ns: int, timeout_ns: int) -> list[str]:
        """Kill workers that have held a batch longer than `timeout_ns`; supervision then
        restarts them and hands their batches back, as after any death."""
        hung = []
        for worker in self.workers.values():
            oldest = min((sent for _, sent in worker.inflight.values()), default=None)
            if oldest is not None and now_ns - oldest > timeout_ns and worker.proc and worker.proc.returncode is None:
                log.error("worker %s has held a batch for %.1f s; killing it", worker.name, (now_ns - oldest) / 1e9)
                worker.proc.kill()
                hung.append(worker.name)
        return hung

    def _check_all_ready(self) -> None:
        if all(w.ready or w.failure for w in self.workers.values()):
            self._ready.set()

    def _on_result(self, worker: Worker, result: P.BatchResult, frames: list[bytes]) -> None:
        entry = worker.inflight.pop(result.batch_id, None)
        worker.stats.inflight = len(worker.inflight)
        worker.exclusive = False
        if entry is None:
            return
        batch, _ = entry
        worker.stats.batches += 1
        worker.stats.items += len(batch.items)
        worker.stats.busy_ns += result.compute_ns
        self.on_result(worker, batch, result, frames)

    def snapshot(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [w.stats.snapshot(now) for w in self.workers.values()]
