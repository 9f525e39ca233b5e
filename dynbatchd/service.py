"""The daemon: sockets, signals, timers and worker supervision around the engine.

The path of one request: the front end decodes it -> `on_request` hands its
metadata to the intake (`dynbatchd.engine.intake`: routing, tenancy, compliance,
quota, cache key, deadline) and submits the Job it returns to the engine ->
`_pump` sends the engine's dispatches to the workers and its answers to the
clients -> a worker's result goes back through `engine.completed`. Every
decision (what to batch, where to send it, what to answer) is the engine's,
but for a causal-lm request, which its worker's step loop batches
(`dynbatchd.generating`); this module only carries messages. Every accepted
request ends in exactly one reply.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import time
from typing import Any, Callable

import zmq

from dynbatchd import __version__, collector, protocol as P, systemd
from dynbatchd.audit import FILE_NAME as AUDIT_FILE, AuditLog
from dynbatchd.cache import ResultCache
from dynbatchd.cache_operations import CacheOperations
from dynbatchd.canary_operations import CanaryOperations
from dynbatchd.config import Config, state_path
from dynbatchd.control.server import ControlServer
from dynbatchd.daemon_batches import Pending, decode_outcome, encode_batch, fingerprint, freeze, unencodable
from dynbatchd.observer import observe_devices
from dynbatchd.devices.pool import DevicePool, device_names, pool_class
from dynbatchd.doors import LocalEnvelope
from dynbatchd.engine import OK, Answer, Engine, Job
from dynbatchd.generating import Generations
from dynbatchd.ipcfiles import WorkerSocketDir
from dynbatchd.engine.intake import Intake, Refusal, RequestMeta
from dynbatchd.memory import device_limits
from dynbatchd.membership import Membership
from dynbatchd.listeners import StartupError, bind
from dynbatchd.logs import LineBudget, request_fields, safe_id
from dynbatchd.operations import Operations
from dynbatchd.plugins import Plugins
from dynbatchd.quotas import Quotas, quotas_on
from dynbatchd.scheduler import build_channels
from dynbatchd.telemetry import NvmlProbe
from dynbatchd.tenantmetrics import PENDING_KINDS, TenantAnswers
from dynbatchd.transport import FrontEnd

log = logging.getLogger("dynbatchd")

# The level of the line logged for a request answered with an error; other codes log at debug.
ANSWER_LEVELS = {P.MODEL_ERROR: logging.WARNING, P.REFUSED: logging.INFO}
__all__ = ["Daemon", "StartupError"]


class Daemon:
    def __init__(self, config: Config, plugins: Plugins, *, config_path: str | None = None,
                 clock: Callable[[], int] = time.monotonic_ns):
        self.config = config
        self.config_path = config_path
        self.plugins = plugins
        self.operations = Operations(self)   # status, metrics, tune, reload, stop (composed: operations.py)
        config = self.config = self.operations.init_tuning(config)   # the config file, then the tuning drop-in
        self.clock = clock
        self.started_ns = clock()
        self.state = "starting"
        self.cache = ResultCache(config.cache.entries, config.cache.max_bytes) if config.cache.entries else None
        # `is not None`: an empty cache has len 0, and the policy must apply from the first request
        self.cache_rule = plugins.cache_policies()[config.cache.policy](config) if self.cache is not None else None
        self.cache_ops = CacheOperations(self)   # the sketch, warmup and erasure
        self.top_users = self.cache_ops.load_top_users(config)   # texts only for the cache; users as keyed hashes
        self.tenant_answers = TenantAnswers(models=config.models)   # for /metrics: top tenants + (other)
        self._answer_lines = LineBudget()   # per-request error lines: a storm of them is counted, not written
        self._top_users_saved = self.top_users.observed if self.top_users else 0
        self.quotas = Quotas(config.quotas, clock)   # per tenant, before a request takes queue room
        self.intake = Intake.from_plugins(
            config, plugins, cache_on=self.cache is not None, cache_rule=self.cache_rule,
            quota=lambda tenant, pending: self.quotas.admit(self.config.quotas, tenant, pending),
            quota_on=lambda config: quotas_on(config.quotas),   # (no quota call a request while none is set)
            observe_user=self.top_users.observe if self.top_users is not None else None,
            loading=lambda model: self.membership.unready(model))   # `curve` once the front end is bound
        self.devices = device_names(config.devices)
        self.membership = Membership(self, config)   # the models the workers hold (a reload adds and removes)
        channels = build_channels(config.channels, plugins.window_policies(), plugins.batch_sizers())
        self.engine = Engine(channels, self.devices, inflight=config.devices.inflight,
                             feeders=config.devices.workers_per_device,
                             queue_lead_ns=int(config.devices.queue_lead_ms * 1e6), cache=self.cache,
                             freeze=freeze, fingerprint=fingerprint, now_ns=self.started_ns, pass_clock=clock,
                             device_limits=device_limits(config, self.devices, plugins.runners(), NvmlProbe()))   # sized per device
        self.audit = AuditLog(config.compliance.audit_log or state_path(config.daemon, AUDIT_FILE))
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0
        self._pump_scheduled = False
        self._stop = asyncio.Event()
        self._settled = asyncio.Event()   # draining, and nothing is queued or running any more
        self.front: FrontEnd | None = None
        self.pool: DevicePool | None = None
        self.control: ControlServer | None = None
        self._queued: dict[tuple[bytes, Any], Job] = {}   # (client identity, request id) -> job, for cancel
        self.doors: list[Any] = []   # started front-door plugins (dynbatchd_front_doors)
        self.canary = CanaryOperations(self)   # a channel's candidate settings on a share of its traffic
        self.generation = Generations(self)   # causal-lm requests: their workers' step loops, chunks, ends

    # -- lifecycle ----------------------------------------------------------
    async def run(self) -> int:
        loop = self.loop = asyncio.get_running_loop()
        self.exit_code = 0                # 1 once every device stayed given up ([devices] give_up_exit_s)
        self._give_up_timer: asyncio.TimerHandle | None = None
        ctx = zmq.Context.instance()
        metrics = await bind(self, ctx)   # every address before any model loads: a clash fails in a second
        self.intake.curve = self.front.curve
        sockets = WorkerSocketDir()   # the worker sockets' private directory
        ops = self.operations
        for sig, handler in ((signal.SIGTERM, ops.request_stop), (signal.SIGINT, ops.request_stop),
                             (signal.SIGHUP, ops.reload_from_signal)):
            loop.add_signal_handler(sig, handler)
        self.control.io.start(loop)
        watchdog = systemd.start_watchdog(loop)   # pings from this loop: a stuck loop gets restarted
        models = list(self.membership.model_specs.values())
        make_pool = pool_class(self.config.devices)   # local worker processes, or Ray actors
        self.pool = make_pool(ctx, self.devices, models, cpu_threads=self.config.devices.cpu_threads,
                              ipc_dir=sockets.path, restart_limit=self.config.devices.restart_limit,
                              probe_after_s=self.config.devices.probe_after_s,
                              on_result=self._on_result, on_lost=self._on_lost, on_ready=self._on_ready,
                              on_gone=self._on_gone, on_read_done=self._pump_if_scheduled,
                              log_level=self.config.daemon.log_level, feeders=self.config.devices.workers_per_device,
                              log_format=self.config.daemon.log_format)
        self.pool.on_generation = self.generation.on_message
        log.info("dynbatchd %s starting: devices %s, models %s", __version__, ", ".join(self.devices),
                 ", ".join(self.config.models))
        starting = asyncio.ensure_future(self.pool.start(timeout_s=600))
        stopped = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait([starting, stopped], return_when=asyncio.FIRST_COMPLETED)
        code = 0
        if not starting.done():   # stopped while workers were still loading
            starting.cancel()
            log.info("stopped during start-up")
        elif starting.exception() is not None:
            log.error("could not start device workers: %s", starting.exception())
            code = 1
        else:
            stopped.cancel()
            await self._serve()
            code = self.exit_code
        if metrics is not None:
            metrics.close()
        await self._close(sockets)
        if watchdog is not None:
            watchdog.cancel()
        # The last replies (shutting_down to what arrived at the end) are still in ZeroMQ's I/O
        # thread: closing every socket with a linger and ending the context sends them before exit.
        await asyncio.get_running_loop().run_in_executor(None, functools.partial(ctx.destroy, linger=2000))
        return code

    async def _serve(self) -> None:
        self.front.io.start(self.loop)
        observer = asyncio.ensure_future(observe_devices(self.engine, self.pool, self.clock, self._schedule_pump,
                                                         self.config.devices.batch_timeout_s))
        self.state = "serving"
        collector.settle_for_serving()
        systemd.notify(f"READY=1\nSTATUS=serving on {self.config.daemon.listen}\nMAINPID={os.getpid()}")
        log.info("serving requests on %s, control on %s", self.config.daemon.listen, self.config.daemon.control)
        saver = asyncio.ensure_future(self.cache_ops.save_top_users_periodically())
        await self._stop.wait()
        observer.cancel()
        saver.cancel()
        await self.operations.drain()
        self.generation.stop()   # generations the drain left unfinished: answered shutting_down
        self.cache_ops.save_top_users()

    async def _close(self, sockets: WorkerSocketDir) -> None:
        for door in self.doors:   # after the drain: every request they brought in was answered
            await door.stop()
        if self.pool:
            await self.pool.stop()
        if self.front is not None:   # what came in the last moment is answered shutting_down, not dropped
            self.front.io.stop()
            self.front.io.flush()
        for part in (self.front, self.control):
            if part is not None:
                part.close(linger=2000)   # the replies still go out; an ipc:// socket's file goes
        sockets.remove()

    # -- admission ----------------------------------------------------------
    def on_request(self, envelope: list[bytes], request: P.Request, frames: list[bytes]) -> None:
        """A translator: the request's metadata to the intake (dynbatchd.engine.intake), its Job to
        the engine, a refusal to the client."""
        front = self.front
        if request.cancel:   # no reply of its own: the request it names is answered, once
            if self.generation.cancel(envelope[0], request.id):
                return
            job = self._queued.get((envelope[0], request.id))
            self._send([answer] if job and (answer := self.engine.cancel(job, self.clock())) else ())
            return
        if self.state not in ("serving", "unavailable"):
            self._reject(envelope, request, P.SHUTTING_DOWN, "daemon is shutting down")
            return
        # Written out (one call less a request): a socket client's CURVE key, or a door's API key tenant and channels
        door = isinstance(envelope, LocalEnvelope)
        meta = RequestMeta(request.model, P.estimate_tokens(request), tuple(request.tags), request.request_type,
                           request.user_frequency, request.priority, request.tenant, envelope.tenant if door else None,
                           None if door else front.peer, request.user, request.text, request.deadline_ms, None,
                           envelope.channels if door else ())
        admitted = self.intake.admit(meta, Pending(envelope, request, frames))
        if isinstance(admitted, Refusal):
            if admitted.rule is not None:
                self.operations.refuse(envelope, request, admitted.channel, admitted.tenant, admitted.rule,
                                       admitted.message)
            else:
                self._reject(envelope, request, admitted.code, admitted.message)
            return
        job, channel = admitted, admitted.channel
        now = self.clock() if door else front.read_ns   # a socket's request arrived when its drain was read
        if self.generation.generative(job.model):
            self.generation.start(job, job.payload, now)
            return
        answer = self.engine.submit(job, now)
        if self.engine.outbox:   # an audit decision (rare), now that submit has returned
            self.operations.carry_out(self.engine.take_events())
        if answer is not None:
            self._send((answer,), channel)
        else:
            self._queued[(envelope[0], request.id)] = job
            self._schedule_pump()

    def _log_answer(self, request: P.Request, code: str, message: str, channel: str | None = None) -> None:
        """One line for a request answered with an error, by its id (dynbatchd.logs), within its code's
        `LineBudget`. Only a model error's message is kept (the daemon's and the worker's own words, never
        an input); the model and the tenant only when the config names them, never what a client sent."""
        level = ANSWER_LEVELS.get(code, logging.DEBUG)
        if not log.isEnabledFor(level) or (more := self._answer_lines.admit(code)) is None:
            return
        config, model = self.config, request.model if request.model in self.config.models else None
        tenant = request.tenant if request.tenant is not None and (
            request.tenant in config.quotas.tenants or request.tenant in config.compliance.key_tenants.values()) else None
        log.log(level, "request %s%s%s: %s%s%s", safe_id(request.id), f" for model {model}" if model else "",
                f" on channel {channel}" if channel else "", code, f" ({message[:200]})" if code == P.MODEL_ERROR else "",
                more,
                extra=request_fields(request.id, channel=channel, model=model, tenant=tenant, code=code))

    def _reject(self, envelope, request: P.Request, code: str, message: str, channel: str | None = None) -> None:
        self.tenant_answers.count(request.tenant, request.model, code)
        self._log_answer(request, code, message, channel)
        if isinstance(envelope, LocalEnvelope):
            envelope.settle(Answer(None, code, message))
        else:
            self.front.reject(envelope, request.id, code, message)

    def _send(self, answers, channel: str | None = None) -> None:
        """Each engine answer as a reply to its client (warmup inputs have none). `channel`: the
        answers' channel, for the log line of an error, when they were never queued (answered at once)."""
        if not answers:   # (most scheduling passes answer nothing)
            return
        front, queued, release = self.front, self._queued, self.quotas.release if self.quotas.holding else None
        counted = self.tenant_answers.pending   # the answers per tenant and model, counted at the next scrape
        for answer in answers:
            pending = answer.payload
            envelope, request = pending.envelope, pending.request
            if envelope is None:
                continue
            job = queued.pop((envelope[0], request.id), None)
            if release is not None:
                release(pending)   # its tenant's in-flight place, whatever the answer
            kind = (request.tenant, request.model, answer.code)
            counted[kind] = counted.get(kind, 0) + 1
            if answer.code != OK:
                self._log_answer(request, answer.code, answer.message, job.channel if job is not None else channel)
            if isinstance(envelope, LocalEnvelope):
                envelope.settle(answer)
            elif front is None:
                continue
            elif answer.code != OK:
                front.reject(envelope, request.id, answer.code, answer.message)
            else:
                value, data = answer.output
                if data is not None:
                    front.reply(envelope, P.Reply(request.id, True, tensor=value, timing=answer.timing), (data,))
                else:
                    front.reply(envelope, P.Reply(request.id, True, value=value, timing=answer.timing))
        if len(counted) >= PENDING_KINDS:
            self.tenant_answers.flush()

    # -- scheduling ---------------------------------------------------------
    def _schedule_pump(self) -> None:
        """Many events in one loop turn (a burst of requests) share one scheduling pass."""
        if not self._pump_scheduled:
            self._pump_scheduled = True
            self.loop.call_soon(self._pump_if_scheduled)

    def _pump_if_scheduled(self) -> None:
        """The scheduling pass asked for, if no other call ran it first. The pool calls this after
        each read of worker results: the results read at once share one pass, and it runs now,
        not after the requests waiting to be read (a free device must not wait for a front-end
        drain)."""
        if self._pump_scheduled:
            self._pump()

    def _pump(self) -> None:
        self._pump_scheduled = False
        now = self.clock()
        dispatches, answers = self.engine.step(now)
        self._send(answers)
        for dispatch in dispatches:
            try:
                frames = encode_batch(dispatch.batch)
            except Exception as exc:   # e.g. a lone surrogate in a text from the HTTP door (valid JSON)
                log.error("batch %d for %s could not be encoded (%s): answering it", dispatch.batch.id,
                          self.devices[dispatch.device], type(exc).__name__)
                self._send(self.engine.unsendable(dispatch.device, dispatch.batch.id, unencodable(dispatch.batch), now))
                self._schedule_pump()
                continue
            worker = dispatch.device * self.engine.feeders + dispatch.feeder   # the pool's numbering
            if not self.pool.send(worker, frames):
                self.engine.undelivered(dispatch.device, dispatch.batch.id)
                self._schedule_pump()
        if self.engine.outbox:   # of step() and unsendable() (rare: looked at, not taken, each pass)
            self.operations.carry_out(self.engine.take_events())
        if self.membership.unloading_models:   # a reload removed them: unloaded once nothing of them is left
            self.membership.unload_drained_models()
        if self.state == "draining" and not self.engine.busy() and not self.generation.jobs:
            self._settled.set()
        wake = self.engine.next_wakeup()
        if wake is None or (self._timer is not None and self._timer_at <= wake):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = wake
        self._timer = self.loop.call_later(max(0, wake - now) / 1e9, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._pump()

    # -- worker events ------------------------------------------------------------
    def _on_result(self, worker: int, result: P.BatchResult, frames: list[bytes]) -> None:
        device = worker // self.engine.feeders
        batch = self.engine.held_batch(device, result.batch_id)
        if batch is None:
            return   # already answered (lost or stopped): a late result must not answer twice
        outcome = decode_outcome(result, frames, len(batch.items))
        if result.memory_bytes:   # what the adaptive sizers see of memory (dynbatchd/observer.py)
            self.engine.note_batch_memory(device, worker % self.engine.feeders, result.memory_bytes)
        if outcome.problem:
            log.error("worker for %s answered batch %d badly: %s", self.devices[device], result.batch_id,
                      outcome.problem)
        self._send(self.engine.completed(device, result.batch_id, outcome, self.clock()))
        if self.engine.outbox:   # a canary's verdict: applied now, after completed()
            self.operations.carry_out(self.engine.take_events())
        self._schedule_pump()

    def _on_lost(self, worker: int) -> bool:
        """Worker `worker` (the pool's number: device x workers_per_device + feeder) died."""
        device, feeder = divmod(worker, self.engine.feeders)
        self.generation.lost(worker)
        loss = self.engine.lost(device, self.clock(), feeder)
        self.operations.carry_out(self.engine.take_events())
        self._send(loss.answers)
        self._schedule_pump()
        return loss.explained

    def _on_ready(self, worker: int) -> None:
        device, feeder = divmod(worker, self.engine.feeders)
        self.engine.device_up(device, feeder)
        if self.membership.loading_models:   # a worker said Ready after a reload's new model set
            self.membership.models_loaded(worker)
        if self._give_up_timer is not None:
            self._give_up_timer.cancel()
            self._give_up_timer = None
        if self.state == "unavailable":
            self.state = "serving"
            log.info("device %s is back: serving again", self.devices[device])
            systemd.notify(f"STATUS=serving on {self.config.daemon.listen}")
        self._schedule_pump()

    def _on_gone(self, device: int) -> None:
        """A device was given up (the pool probes it again later). With none left, requests are
        answered unavailable, and after [devices] give_up_exit_s of that the daemon exits 1 for
        the service manager to restart it."""
        self._send(self.engine.device_gone(device, self.clock()))
        self.operations.carry_out(self.engine.take_events())
        if not self.engine.every_device_gone() or self.state not in ("serving", "unavailable"):
            return
        if self.state == "serving":
            self.state = "unavailable"
            log.error("no device is left: answering every request unavailable (see dynbatchd(8))")
            systemd.notify("STATUS=unavailable: every device was given up")
        limit = self.config.devices.give_up_exit_s
        if limit and self._give_up_timer is None:
            def exit_for_a_restart() -> None:
                self._give_up_timer = None
                if self.state == "unavailable":
                    log.error("every device has been given up for %g s ([devices] give_up_exit_s): exiting with "
                              "status 1 for the service manager to restart the daemon", limit)
                    self.exit_code = 1
                    self.operations.request_stop()
            self._give_up_timer = self.loop.call_later(limit, exit_for_a_restart)
