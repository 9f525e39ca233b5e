"""The daemon: admission, routing and replies around the pure scheduler.

The path of one request: the front end decodes it -> `on_request` routes it
(routing hook), checks it (compliance hook) and queues it -> `_pump` asks
the scheduler which batches to send to which free device slots -> a worker
runs the batch -> `_on_result` answers every request in it. Every accepted
request ends in exactly one reply.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import tempfile
import itertools
import time
from typing import Any, Callable

import zmq

from dynbatchd import __version__, config as cfgmod, protocol as P, systemd
from dynbatchd.cache import ResultCache
from dynbatchd.config import Config, ConfigError
from dynbatchd.control.server import ControlServer
from dynbatchd.devices.observer import observe_devices
from dynbatchd.devices.pool import DevicePool, Worker, detect_devices
from dynbatchd.hookspecs import RequestInfo
from dynbatchd.metrics import render as render_metrics, serve as serve_metrics
from dynbatchd.plugins import Plugins
from dynbatchd.scheduler import Batch, Item, Scheduler, build_channels
from dynbatchd.scheduler.slots import next_opening_ns, open_slots
from dynbatchd.telemetry import daemon_health
from dynbatchd.transport import FrontEnd
from dynbatchd.validation import validate_config
from dynbatchd.warmup import WarmupFeeder

log = logging.getLogger("dynbatchd")

MAX_RETRIES = 1  # a request whose worker died under it is run once more, then answered model_error


class Daemon:
    def __init__(self, config: Config, plugins: Plugins, *, config_path: str | None = None,
                 clock: Callable[[], int] = time.monotonic_ns):
        self.config = config
        self.config_path = config_path
        self.plugins = plugins
        self.clock = clock
        self.started_ns = clock()
        self.state = "starting"
        self.scheduler = Scheduler(build_channels(config.channels, plugins.window_policies(), plugins.batch_sizers()))
        self._next_key = itertools.count(1).__next__
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0
        self._pump_scheduled = False
        self._stop = asyncio.Event()
        self._force = False
        self._stop_now = False   # after draining: nothing may be requeued any more
        self.front: FrontEnd | None = None
        self.pool: DevicePool | None = None
        self.control: ControlServer | None = None
        self.cache = ResultCache(config.cache.entries) if config.cache.entries else None
        self.warmup_feeder = WarmupFeeder(self.scheduler, self._next_key)

    # -- lifecycle ----------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.loop = loop
        ctx = zmq.Context.instance()
        ipc_dir = tempfile.mkdtemp(prefix="dynbatchd-")
        for sig, handler in ((signal.SIGTERM, self.request_stop), (signal.SIGINT, self.request_stop),
                             (signal.SIGHUP, self._reload_from_signal)):
            loop.add_signal_handler(sig, handler)
        self.control = ControlServer(ctx, self.config.daemon.control, self)
        self.control.io.start(loop)
        devices = detect_devices(self.config.devices.use)
        models = [P.ModelSpec(n, m.runner, dict(m.options)) for n, m in self.config.models.items()]
        self.pool = DevicePool(ctx, devices, models, inflight=self.config.devices.inflight,
                               cpu_threads=self.config.devices.cpu_threads, ipc_dir=ipc_dir,
                               queue_lead_ns=int(self.config.devices.queue_lead_ms * 1e6),
                               restart_limit=self.config.devices.restart_limit, on_result=self._on_result,
                               on_lost=self._on_lost, on_capacity=self._schedule_pump, clock=self.clock,
                               log_level=self.config.daemon.log_level)
        log.info("dynbatchd %s starting: devices %s, models %s", __version__, ", ".join(devices), ", ".join(self.config.models))
        starting = asyncio.ensure_future(self.pool.start(timeout_s=600))
        stopped = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait([starting, stopped], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():   # stopped while workers were still loading
            starting.cancel()
            log.info("stopped during start-up")
            await self._close(ipc_dir)
            return 0
        stopped.cancel()
        if starting.exception() is not None:
            log.error("could not start device workers: %s", starting.exception())
            await self._close(ipc_dir)
            return 1
        self.front = FrontEnd(ctx, self.config.daemon.listen, self.config.daemon.max_request_bytes, self.on_request)
        self.front.io.start(loop)
        metrics = await serve_metrics(self.config.daemon.metrics_listen, self.metrics_page) \
            if self.config.daemon.metrics_listen else None
        observer = asyncio.ensure_future(observe_devices(self.pool, self.scheduler.channels, self.clock,
                                                         self._schedule_pump, self.config.devices.batch_timeout_s))
        self.state = "serving"
        systemd.notify(f"READY=1\nSTATUS=serving on {self.config.daemon.listen}\nMAINPID={os.getpid()}")
        log.info("serving requests on %s, control on %s", self.config.daemon.listen, self.config.daemon.control)
        await self._stop.wait()
        observer.cancel()
        if metrics is not None:
            metrics.close()
        await self._drain()
        await self._close(ipc_dir)
        return 0

    def request_stop(self) -> None:
        """First SIGTERM drains (answer what was accepted), a second one stops at once."""
        if self.state == "draining":
            log.warning("second stop signal: answering the rest shutting_down and exiting")
            self._force = True
        self.state = "draining"
        systemd.notify("STOPPING=1")
        self._stop.set()

    async def _drain(self) -> None:
        log.info("draining: %d queued, %d batches in flight", self.scheduler.depth(), self.pool.inflight())
        self.warmup_feeder.backlog.clear()   # warmup is optional work: never let it hold a stop up
        self.scheduler.drain()
        self._pump()
        deadline = self.clock() + int(self.config.daemon.drain_timeout_s * 1e9)
        while (self.scheduler.depth() or self.pool.inflight()) and not self._force and self.clock() < deadline:
            await asyncio.sleep(0.01)
            self._pump()
        leftovers = self.scheduler.poll(self.clock(), 0)  # nothing more may start
        for channel in self.scheduler.channels.values():
            for lane in channel.lanes.values():
                while lane.heap:
                    leftovers.expired.append(lane.pop())
            channel.depth = 0
        for item in leftovers.expired:
            self._fail(item, P.SHUTTING_DOWN, "daemon stopped before this request could run")
        self._stop_now = True
        for worker in self.pool.workers.values():
            self._on_lost(worker, [], [b for b, _ in worker.inflight.values()])

    async def _close(self, ipc_dir: str) -> None:
        if self.pool:
            await self.pool.stop()
        for part in (self.front, self.control):
            if part is not None:
                part.io.stop()
                part.io.sock.close(linger=2000)
        shutil.rmtree(ipc_dir, ignore_errors=True)

    # -- admission ----------------------------------------------------------
    def on_request(self, envelope: list[bytes], request: P.Request, frames: list[bytes]) -> None:
        front = self.front
        if self.state != "serving":
            front.reject(envelope, request.id, P.SHUTTING_DOWN, "daemon is shutting down")
            return
        config = self.config
        if request.model not in config.models:
            front.reject(envelope, request.id, P.UNKNOWN_MODEL, f"no model named {request.model!r}")
            return
        tokens = P.estimate_tokens(request)
        info = RequestInfo(request.model, tuple(request.tags), request.request_type, request.user_frequency,
                           tokens, request.priority, request.tenant, request.user)
        channel = self.plugins.route(info, config)
        if channel not in config.channels:
            log.error("routing named unknown channel %r; using %r", channel, config.routing.default)
            channel = config.routing.default
        if self.plugins.has_admission_checks:
            reason = self.plugins.admit(info, channel, config)
            if reason:
                self.scheduler.channels[channel].stats.refused += 1
                front.reject(envelope, request.id, P.REFUSED, reason)
                return
        now = self.clock()
        cacheable = self.cache is not None and request.text is not None and not config.channels[channel].isolated
        if cacheable:
            hit = self.cache.get((request.model, request.tenant, request.text))
            if hit is not None:
                self._reply_cached(envelope, request, channel, hit, now)
                return
        deadline_ms = request.deadline_ms or config.channels[channel].deadline_ms
        item = Item(self._next_key(), request.model, now, now + int(deadline_ms * 1e6), tokens, request.tenant,
                    (envelope, request, frames), channel)
        if not self.scheduler.submit(item, now):
            limit = config.channels[channel].queue_limit
            why = (f"queue is full ({limit})" if self.scheduler.channels[channel].depth >= limit
                   else "backlogged: the requests ahead cannot be served before this one's deadline")
            front.reject(envelope, request.id, P.OVERLOADED, f"channel {channel!r} {why}")
            return
        self._schedule_pump()

    def _reply_cached(self, envelope: list[bytes], request: P.Request, channel: str, hit: tuple, now: int) -> None:
        output, data = hit
        timing = P.Timing(0, 0, 0, 0, channel, "cache")
        if data is not None:
            self.front.reply(envelope, P.Reply(request.id, True, tensor=output, timing=timing), (data,))
        else:
            self.front.reply(envelope, P.Reply(request.id, True, value=output, timing=timing))
        stats = self.scheduler.channels[channel].stats
        stats.completed += 1
        stats.latency.record(0.0)

    # -- scheduling ---------------------------------------------------------
    def _schedule_pump(self) -> None:
        if not self._pump_scheduled:
            self._pump_scheduled = True
            self.loop.call_soon(self._pump)

    def _pump(self) -> None:
        self._pump_scheduled = False
        now = self.clock()
        if self.warmup_feeder.backlog:
            self.warmup_feeder.feed(self.config.cache.warmup_channel or self.config.routing.default, now)
        if not self.scheduler.depth():
            return   # nothing queued: nothing to dispatch, expire or wake up for
        pool, lead, inflight = self.pool, self.pool.queue_lead_ns, self.pool.inflight_limit
        views = pool.views(now, self._estimate)   # one snapshot; dispatch keeps it current
        while True:   # each dispatch may open the device's next slot: ask again until none opens
            free, busy = open_slots(views, now, inflight, lead)
            decision = self.scheduler.poll(now, free, busy)
            for item in decision.expired:
                self._fail(item, P.DEADLINE_EXCEEDED, "deadline passed before the request could run")
            sent = 0
            for batch in decision.batches:
                if pool.dispatch(batch, encode_batch(batch), now, views, self._estimate):
                    sent += 1
                else:
                    self.scheduler.requeue(batch.items)   # a retried request waits for an idle worker
            if not sent:
                break
        wake = self.scheduler.next_wakeup(now, free, busy)
        if self.scheduler.depth():   # a queued slot opening soon is worth waking for
            opening = next_opening_ns(views, now, inflight, lead)
            if opening is not None:
                wake = opening if wake is None else min(wake, opening)
        self._arm(wake, now)

    def _estimate(self, batch: Batch) -> int:
        return self.scheduler.channels[batch.channel].cost.estimate_ns(len(batch.items), batch.tokens)

    def _arm(self, wake_ns: int | None, now_ns: int) -> None:
        if wake_ns is None or (self._timer is not None and self._timer_at <= wake_ns):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = wake_ns
        self._timer = self.loop.call_later(max(0, wake_ns - now_ns) / 1e9, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._pump()

    # -- replies ------------------------------------------------------------
    def _on_result(self, worker: Worker, batch: Batch, result: P.BatchResult, frames: list[bytes]) -> None:
        now = self.clock()
        self.scheduler.completed(batch, result.compute_ns, now)
        if result.oom:
            self.scheduler.out_of_memory(batch)
        stats = self.scheduler.channels[batch.channel].stats
        n = len(batch.items)
        problem = result_problem(result, frames, n)
        if problem:
            log.error("worker %s answered batch %d badly: %s", worker.name, batch.id, problem)
            for item in batch.items:
                self._fail(item, P.MODEL_ERROR, f"the model's worker answered badly: {problem}")
            self._pump()
            return
        compute_us = result.compute_ns // 1000
        out, row = result.output, 0
        if out is not None:
            buf = memoryview(frames[0])
            row = len(buf) // n if n else 0
            item_ref = P.TensorRef(out.dtype, out.shape[1:], 0)
        cache = self.cache
        isolated = self.config.channels[batch.channel].isolated   # regulated data is never cached
        for i, item in enumerate(batch.items):
            envelope, request, _ = item.payload
            if i in result.errors:
                self._fail(item, P.BAD_REQUEST if i in result.rejected else P.MODEL_ERROR, result.errors[i])
                continue
            data = buf[i * row:(i + 1) * row] if out is not None else None
            if cache is not None and request.text is not None and not isolated:
                cache.put((batch.model, request.tenant, request.text), item_ref if out is not None else result.values[i],
                          bytes(data) if data is not None else None)
            if envelope is None:  # a warmup input: it only fills the cache
                continue
            total_us = (now - item.arrival_ns) // 1000   # queue: all of it but compute (hand-over included)
            timing = P.Timing(max(0, total_us - compute_us), compute_us, total_us, n, batch.channel,
                              worker.device, result.simulated)
            if out is not None:
                self.front.reply(envelope, P.Reply(request.id, True, tensor=item_ref, timing=timing), (data,))
            else:
                self.front.reply(envelope, P.Reply(request.id, True, value=result.values[i], timing=timing))
            stats.completed += 1
            if now > item.deadline_ns:
                stats.late += 1
            stats.latency.record((now - item.arrival_ns) / 1000)
        self._pump()

    def _fail(self, item: Item, code: str, message: str) -> None:
        envelope, request, _ = item.payload
        if envelope is None:  # a warmup input: nobody waits for it
            return
        stats = self.scheduler.channels[item.channel].stats
        if code != P.DEADLINE_EXCEEDED:
            stats.failed += 1
        stats.latency.record((self.clock() - item.arrival_ns) / 1000)
        self.front.reject(envelope, request.id, code, message)

    def _on_lost(self, worker: Worker, running: list[Batch], waiting: list[Batch]) -> None:
        """A worker died: what it was running runs once more, alone, or is answered; what
        was only waiting behind it is requeued as it was."""
        retry: list[Item] = []
        for batch in running:
            for item in batch.items:
                if item.retries < MAX_RETRIES:
                    item.retries += 1
                    retry.append(item)
                else:
                    self._fail(item, P.MODEL_ERROR, f"worker for {worker.device} died twice while running this request")
        retry.extend(item for batch in waiting for item in batch.items)
        if self.state == "draining" and self._stop_now:
            for item in retry:
                self._fail(item, P.SHUTTING_DOWN, "daemon stopped while this request was running")
            return
        self.scheduler.requeue(retry)
        self._schedule_pump()

    # -- warmup -------------------------------------------------------------
    def warmup(self, model: str | None, top_users: int) -> dict[str, int]:
        """Queue the inputs the warmup plugins name; they run in the warmup channel as it has room."""
        queued = cached = 0
        for m in [model] if model else list(self.config.models):
            for job in self.plugins.warmup_jobs(m, top_users, self.config):
                q, c = self.warmup_feeder.add(job.model, job.inputs, self.cache)
                queued, cached = queued + q, cached + c
        self._schedule_pump()
        return {"queued": queued, "already_cached": cached, "backlog": len(self.warmup_feeder.backlog)}

    # -- control ------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now = self.clock()
        channels = self.scheduler.snapshot(now)
        devices = self.pool.snapshot() if self.pool else []
        deadlines = {name: c.deadline_ms for name, c in self.config.channels.items()}
        return {
            "daemon": {"version": __version__, "pid": os.getpid(), "state": self.state,
                       "uptime_s": round((now - self.started_ns) / 1e9, 3), "config": self.config.source,
                       "listen": self.config.daemon.listen,
                       "bad_requests": self.front.bad_requests if self.front else 0,
                       "dropped": self.front.dropped if self.front else 0,
                       "health": daemon_health(channels, deadlines, devices,
                                               self.pool.memory_used if self.pool else 0.0)},
            "channels": channels,
            "devices": devices,
            "cache": {**self.cache.snapshot(), "warmup_backlog": len(self.warmup_feeder.backlog)} if self.cache is not None else None,
        }

    def metrics_page(self) -> str:
        return render_metrics(self.status(), {name: c.stats.latency.lifetime
                                              for name, c in self.scheduler.channels.items()})

    def apply_config(self, new: Config) -> list[str]:
        """Adopt a validated config: channel settings, policies and routing change in place.

        Returns the sections that cannot change without a restart (daemon,
        devices, models, cache); they keep running as they are and the rest is
        applied. Adding or removing a channel is refused outright.
        """
        validate_config(new, self.plugins)
        old = self.config
        if set(old.channels) != set(new.channels):
            raise ConfigError(new.source, "channels", "adding or removing channels needs a restart; "
                              "nothing was applied")
        needs_restart = [key for key in ("daemon", "devices", "models", "cache")
                         if cfgmod.to_dict(getattr(old, key)) != cfgmod.to_dict(getattr(new, key))]
        rebuilt = build_channels(new.channels, self.plugins.window_policies(), self.plugins.batch_sizers())
        for name, channel in self.scheduler.channels.items():
            if cfgmod.to_dict(channel.settings) != cfgmod.to_dict(new.channels[name]):
                channel.settings = new.channels[name]
                channel.window = rebuilt[name].window
                channel.sizer = rebuilt[name].sizer
        self.config = new if not needs_restart else _keep(old, new)
        self._schedule_pump()
        return needs_restart

    def reload(self) -> list[str]:
        if not self.config_path:
            raise ConfigError(self.config.source, "", "daemon was started without a config file")
        systemd.notify("RELOADING=1")
        try:
            return self.apply_config(cfgmod.load(self.config_path))
        finally:
            systemd.notify("READY=1")

    def _reload_from_signal(self) -> None:
        try:
            pending = self.reload()
            log.info("configuration reloaded%s", f"; needs a restart to change: {', '.join(pending)}" if pending else "")
        except ConfigError as exc:
            log.error("reload refused, keeping the running configuration: %s", exc)


def _keep(old: Config, new: Config) -> Config:
    """`new`, but with the parts that need a restart kept as they run now."""
    import msgspec

    return msgspec.structs.replace(new, daemon=old.daemon, devices=old.devices, models=old.models, cache=old.cache)


def result_problem(result: P.BatchResult, frames: list[bytes], n: int) -> str | None:
    """Why a worker's answer cannot be split into `n` replies, or None."""
    if result.output is not None:
        if not result.output.shape or result.output.shape[0] != n:
            return f"output shape {result.output.shape} for a batch of {n}"
        return P.check_tensor(result.output, [len(f) for f in frames])
    if result.values is None and len(result.errors) == n:
        return None   # every input failed on its own: each has its error
    if result.values is None or len(result.values) != n:
        return f"{0 if result.values is None else len(result.values)} outputs for a batch of {n}"
    return None


def encode_batch(batch: Batch) -> list[Any]:
    """BatchMsg header plus the tensor frames of its requests, renumbered."""
    items, frames = [], []
    for item in batch.items:
        _, request, req_frames = item.payload
        if request.tensor is not None:
            ref = P.TensorRef(request.tensor.dtype, request.tensor.shape, len(frames))
            frames.append(req_frames[request.tensor.frame])
            items.append(P.BatchItem(tensor=ref, tokens=item.tokens))
        else:
            items.append(P.BatchItem(text=request.text, value=request.value, tokens=item.tokens))
    return [P.encoder.encode(P.BatchMsg(batch.id, batch.model, items)), *frames]
