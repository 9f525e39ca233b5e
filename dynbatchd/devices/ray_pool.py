"""Devices on Ray actors: one actor per GPU (or per CPU slot), anywhere in a Ray cluster.

The same contract as `DevicePool`, so the engine and the daemon cannot tell
them apart: `send` an encoded batch to device `index`, hear `on_result`,
`on_lost` (the actor died with batches in flight: the engine retries or
answers them), `on_ready` (a replacement came up) and `on_gone` (restart
budget spent). An actor runs the very code a local worker runs (the same
runners, `execute` and result encoding), so a batch's outcome does not depend
on where it ran; only the transport differs: a Ray actor call instead of an
ipc:// message.

Ray is an optional extra: nothing here imports it before a pool is built, and
without it building one fails with a message saying what to install. Actors
are placed by Ray resource requests (`num_gpus=1` per GPU actor) and are
never restarted by Ray itself (`max_restarts=0`): the pool replaces them,
under the same `RestartBudget` as local workers (a given-up device is probed
again like a local one). A dead actor is noticed by the calls in flight on
it, and, idle, by a `watch` call that never returns while it lives (in its
own concurrency group, so batches still run one at a time).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from dynbatchd import protocol as P
from dynbatchd.devices.execution import describe
from dynbatchd.devices.restarts import RestartBudget

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'dynbatchd[ray]'"
WATCH_GROUP = "watch"   # the actor's concurrency group for `watch`, beside the one that runs batches


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError(f"[devices] ray needs Ray, which cannot be imported ({exc}): {INSTALL_HINT}") from None
    return ray


def _as_bytes(frame: Any) -> bytes:
    buffer = getattr(frame, "buffer", None)   # a zmq.Frame received without copying
    return bytes(buffer if buffer is not None else frame)


class RayWorker:
    """The actor: loads its models once, then runs one batch per call (Ray runs calls in order)."""

    def __init__(self, setup: bytes, log_level: str = "info", log_format: str = "text"):
        from dynbatchd.devices.worker import load_runners

        if log_format == "json":
            from dynbatchd.logs import setup as log_setup
            log_setup(log_level, "json", worker="ray")
        else:
            logging.basicConfig(level=log_level.upper(), format="%(asctime)s ray-worker %(levelname)s %(message)s")
        self.setup = P.daemon_decoder.decode(setup)
        self.failure = ""
        try:
            self.runners = load_runners(self.setup)
        except Exception as exc:   # reported by ready(), as a local worker's Failed message
            self.runners, self.failure = {}, describe(exc)

    def ready(self) -> dict[str, Any]:
        import ray

        context = ray.get_runtime_context()
        return {"failure": self.failure, "pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                "actor": context.get_actor_id(), "device": self.setup.device, "models": list(self.runners),
                "simulated": [n for n, r in self.runners.items() if r.simulated]}

    def watch(self) -> None:
        """Never returns (it runs in its own concurrency group): its call fails when the actor dies,
        so the pool hears of a death even while no batch is in flight."""
        import threading

        threading.Event().wait()

    def run(self, frames: list[bytes]) -> list[bytes]:
        from dynbatchd.devices.execution import execute
        from dynbatchd.devices.worker import decode_inputs, encode_result

        msg = P.daemon_decoder.decode(frames[0])
        runner = self.runners[msg.model]
        inputs, tokens = decode_inputs(msg, frames[1:])
        start = time.perf_counter_ns()
        run = execute(runner, inputs, tokens, msg.model)
        compute_ns = time.perf_counter_ns() - start
        return [bytes(f) for f in encode_result(msg.batch_id, run, compute_ns, runner.simulated)]


@dataclass
class RayDevice:
    index: int
    name: str
    device: str                                   # what the actor's runners get: "cuda:0" or "cpu"
    actor: Any = None
    generation: int = 0                           # bumped at each death: one loss per actor
    state: str = "starting"
    failure: str = ""
    simulated: bool = False
    restarts: int = 0
    pid: int = 0
    node: str = ""
    actor_id: str = ""
    actor_name: str = ""
    budget: RestartBudget | None = None


class RayDevicePool:
    """`DevicePool`'s interface over Ray actors (see the module docstring)."""

    def __init__(self, ctx: Any, devices: list[str], models: list[P.ModelSpec], *, cpu_threads: int, ipc_dir: str,
                 restart_limit: int, probe_after_s: float = 30.0,
                 on_result: Callable[[int, P.BatchResult, list[bytes]], None],
                 on_lost: Callable[[int], bool], on_ready: Callable[[int], None], on_gone: Callable[[int], None],
                 on_read_done: Callable[[], None] = lambda: None, log_level: str = "info", ray: Any = None,
                 feeders: int = 1, log_format: str = "text"):
        if feeders != 1:   # (config refuses it: [devices] workers_per_device with ray)
            raise ValueError("Ray devices have one actor each: workers_per_device must be 1")
        self.ray = import_ray()
        self.settings = ray
        self.models = models
        self.cpu_threads = cpu_threads
        self.on_result, self.on_lost, self.on_ready, self.on_gone = on_result, on_lost, on_ready, on_gone
        self.on_read_done = on_read_done   # after each result (Ray delivers them one at a time)
        self.log_level, self.log_format = log_level, log_format
        target = "cuda:0" if ray.gpus else "cpu"   # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES
        self.workers = [RayDevice(i, name, target, budget=RestartBudget(restart_limit, probe_s=probe_after_s))
                        for i, name in enumerate(devices)]
        self._calls: dict[int, set[asyncio.Task]] = {w.index: set() for w in self.workers}
        self._ready = asyncio.Event()
        self._closing = False
        self._started_ray = False
        self._tasks: set[asyncio.Task] = set()
        self._remote: Any = None

    # -- lifecycle ----------------------------------------------------------
    async def start(self, timeout_s: float) -> None:
        ray = self.ray
        if not ray.is_initialized():
            await asyncio.to_thread(ray.init, address=self.settings.address, namespace=self.settings.namespace,
                                    logging_level=logging.WARNING, log_to_driver=False)
            self._started_ray = True
        self._remote = ray.remote(concurrency_groups={WATCH_GROUP: 1})(RayWorker)
        for worker in self.workers:
            self._spawn(worker)
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(f"Ray actors not ready after {timeout_s:g} s (does the cluster have the "
                               f"resources? see `ray status`)") from None
        failed = [w for w in self.workers if w.failure]
        if failed:
            raise RuntimeError("; ".join(f"{w.name}: {w.failure}" for w in failed))

    def _spawn(self, worker: RayDevice) -> None:
        s = self.settings
        worker.state = "starting"
        options = {"num_gpus": 1 if s.gpus else 0, "num_cpus": s.cpus_per_actor, "max_restarts": 0,
                   "max_task_retries": 0}
        setup = P.encoder.encode(P.Setup(worker.device, self.models, self.cpu_threads))
        # Named (unique per daemon and incarnation), so an operator can find it: ray.get_actor(name, namespace)
        worker.actor_name = f"dynbatchd-{os.getpid()}-{worker.name}-{worker.generation}"
        worker.actor = self._remote.options(name=worker.actor_name, **options).remote(setup, self.log_level, self.log_format)
        self._track(self._await_ready(worker, worker.actor, worker.generation))

    def _track(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _await_ready(self, worker: RayDevice, actor: Any, generation: int) -> None:
        try:
            info = await actor.ready.remote()
        except Exception as exc:
            if not self._ready.is_set():   # never came up at start: a failure to report, not a death
                worker.failure, worker.state = f"actor did not start ({type(exc).__name__})", "failed"
                self._check_all_ready()
            else:
                await self._lost(worker, generation)
            return
        if generation != worker.generation or self._closing:
            return
        if info["failure"]:
            worker.failure, worker.state = info["failure"], "failed"
            log.error("ray device %s failed to start: %s", worker.name, info["failure"])
            self._check_all_ready()
            return
        self._track(self._watch(worker, actor, generation))
        worker.state, worker.simulated = "ready", bool(info["simulated"])
        worker.pid, worker.node, worker.actor_id = info["pid"], info["node"], info["actor"]
        log.info("ray device %s ready on node %s (actor %s, pid %d): %s", worker.name, worker.node,
                 worker.actor_id, worker.pid, ", ".join(info["models"]))
        self._check_all_ready()
        self.on_ready(worker.index)

    async def _watch(self, worker: RayDevice, actor: Any, generation: int) -> None:
        try:
            await actor.watch.options(concurrency_group=WATCH_GROUP).remote()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if generation == worker.generation and not self._closing:
                log.error("ray device %s lost its actor %s (%s)", worker.name, worker.actor_id, type(exc).__name__)
                await self._lost(worker, generation)

    def _check_all_ready(self) -> None:
        if all(w.state == "ready" or w.failure for w in self.workers):
            self._ready.set()

    async def stop(self, timeout_s: float = 10.0) -> None:
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        for worker in self.workers:
            if worker.actor is not None:
                try:
                    self.ray.kill(worker.actor, no_restart=True)
                except Exception:
                    pass
        if self._started_ray:
            await asyncio.wait_for(asyncio.to_thread(self.ray.shutdown), timeout_s)

    def kill(self, index: int, why: str) -> None:
        """Replace an actor (hung on a batch): its calls fail, the engine hears it lost."""
        worker = self.workers[index]
        if worker.actor is not None and worker.state == "ready":
            log.error("ray device %s %s; killing its actor %s", worker.name, why, worker.actor_id)
            self.ray.kill(worker.actor, no_restart=True)

    # -- feeding ------------------------------------------------------------
    def send(self, index: int, frames: list[Any]) -> bool:
        """Call the actor with an encoded batch; False when it is not up."""
        worker = self.workers[index]
        if worker.state != "ready" or worker.actor is None:
            return False
        ref = worker.actor.run.remote([_as_bytes(f) for f in frames])
        calls = self._calls[index]
        task = self._track(self._await_result(worker, ref, worker.generation))
        calls.add(task)
        task.add_done_callback(calls.discard)
        return True

    async def _await_result(self, worker: RayDevice, ref: Any, generation: int) -> None:
        try:
            frames = await ref
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if generation == worker.generation and not self._closing:
                log.error("ray device %s lost its actor %s mid-batch (%s)", worker.name, worker.actor_id,
                          type(exc).__name__)
                await self._lost(worker, generation)
            return
        try:
            msg = P.worker_decoder.decode(frames[0])
        except Exception:
            log.error("undecodable result from ray device %s", worker.name)
            return   # the hung-batch watchdog replaces the actor
        if isinstance(msg, P.BatchResult):
            self.on_result(worker.index, msg, frames[1:])
            self.on_read_done()

    async def _lost(self, worker: RayDevice, generation: int) -> None:
        """The actor of `generation` died: deliver what it finished, report the loss once, replace it."""
        if generation != worker.generation or self._closing:
            return
        worker.generation += 1
        worker.state = "restarting"
        others = [t for t in self._calls[worker.index] if t is not asyncio.current_task()]
        if others:   # calls that finished just before the death still count as answered
            await asyncio.wait(others, timeout=0.1)
        try:
            self.ray.kill(worker.actor, no_restart=True)
        except Exception:
            pass
        explained = self.on_lost(worker.index)
        restart = worker.budget.died(asyncio.get_running_loop().time(), explained)
        if restart.given_up:
            worker.state = "failed"
            log.error("ray device %s died %d times in %g s; giving it up, probing it again in %g s", worker.name,
                      len(worker.budget.deaths), worker.budget.window_s, restart.delay_s)
            self.on_gone(worker.index)
        worker.restarts += 1
        await asyncio.sleep(restart.delay_s)
        if not self._closing:
            self._spawn(worker)

    def describe(self, index: int) -> dict[str, Any]:
        """What status shows of a device beside the engine's counters: where it lives."""
        w = self.workers[index]
        return {"name": w.name, "index": w.index, "pid": w.pid, "state": w.state, "restarts": w.restarts,
                "simulated": w.simulated, "node": w.node, "actor": w.actor_id,
                "actor_name": w.actor_name}
