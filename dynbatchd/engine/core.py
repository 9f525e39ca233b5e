"""The sans-I/O core that both the daemon and the simulator drive.

It owns the scheduler, the device table (what each device holds and when it
should be done), retries, the quarantine of poison inputs, the result cache,
the warmup backlog and every counter. Drivers feed it events with their own
clock reading and carry out what it returns:

    submit(job, now)                 -> None (queued) or the Answer to send now
    step(now)                        -> (dispatches to send, answers to send)
    completed(device, id, outcome, now) -> answers
    lost(device, now, feeder)        -> Loss(answers, explained)
    unsendable(device, id, bad, now) -> answers (a batch that could not be encoded)
    overdue(now, timeout)            -> [(device, feeder, limit)] hung: to be killed (lost() follows)
    next_wakeup()                    -> when step() should run again (None: on the next event)
    take_events()                    -> [AuditEvent | VerdictEvent] decided since the last take

The engine never calls out: an isolation decision for the audit trail and a
canary's verdict wait in its outbox until the driver takes them, after the
call that made them has returned (`dynbatchd.engine.events`).

A device may be fed by several worker processes (`feeders`, [devices]
workers_per_device): the engine still sees one device, with one memory and
one speed, and places each batch on the device first, then on its
least-loaded feeder that is up (`Dispatch.feeder`). A feeder that dies costs
only its own batches; the device serves while any feeder is up.

No sockets, threads, asyncio or clocks here: the live daemon
(`dynbatchd.service`) and the discrete-event simulator (`dynbatchd.simulate.driver`)
make the same decisions because they call the same methods. A job's
`payload` is the driver's own business (a reply address, a trace index);
the engine hands it back in every Dispatch and Answer.

This module is the front (requests, scheduling passes, completions, stopping);
the engine's other jobs each have a module of the package: `records` (the
data), `events` (the outbox's records), `placement` + `slots` (which device
takes a batch), `canary` (live splits), `recovery` (dead, hung or full
devices), `reload`, `warmup` and `view` (what drivers may read).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any, Callable, Hashable, Sequence

from dynbatchd import protocol as P
from dynbatchd.engine.canary import Canaries
from dynbatchd.engine.events import AuditEvent, EngineEvent
from dynbatchd.engine.placement import Placement
from dynbatchd.engine.records import (  # noqa: F401 (re-exported: `dynbatchd.engine.core` named them all before the split)
    ANONYMOUS_RULE, LATENCY_PERIOD_NS, MAX_RETRIES, OK, QUARANTINE_SIZE, SUSPECT_FACTOR, SUSPECT_FLOOR_NS,
    WARMUP_DEADLINE_NS, Answer, Device, Dispatch, Job, Loss, Outcome, Split)
from dynbatchd.engine.recovery import Recovery
from dynbatchd.engine.reload import Reloads
from dynbatchd.engine.slots import next_opening_ns, open_slots
from dynbatchd.engine.view import ReadModel
from dynbatchd.engine.warmup import Warmup
from dynbatchd.scheduler import Channel, Scheduler
from dynbatchd.telemetry import DeviceStats, SchedulingPasses

# What a generate request counts in its channel (`count_generated`): accepted, then how it ended.
GENERATED_COUNTERS = frozenset({"accepted", "completed", "expired", "cancelled", "failed"})
NO_EVENTS: tuple[EngineEvent, ...] = ()   # what `take_events` returns when there is nothing to carry out


class Engine(Placement, Canaries, Recovery, Reloads, Warmup, ReadModel):
    """The engine's front (requests in, answers and dispatches out); its other jobs live in the
    mixins named above, one module each."""

    def __init__(self, channels: dict[str, Channel], devices: list[str], *, inflight: int = 2, feeders: int = 1,
                 queue_lead_ns: int = 1_000_000, cache: Any = None, freeze: Callable[[Any], Any] = lambda o: o,
                 fingerprint: Callable[[Any], Hashable] | None = None, now_ns: int = 0,
                 device_limits: Sequence[tuple[int, int]] | None = None, pass_clock: Callable[[], int] | None = None):
        self.scheduler = Scheduler(channels)
        # (most items, most tokens) one batch may carry on each device (0: no limit): a mixed pool's
        # smaller device gets a batch cut to its own size, the rest waits for the next device.
        # An entry may add where the limit came from (items, tokens, "config" / "NVML" / "runner"), for status.
        self.device_limits = [(lim[0], lim[1]) for lim in device_limits] if device_limits else [(0, 0)] * len(devices)
        self.limit_sources = [lim[2] if len(lim) > 2 else "runner" if any(lim) else ""
                              for lim in device_limits] if device_limits else [""] * len(devices)
        # devices of different sizes learn an out-of-memory each for itself; alike, the channel's sizer does
        self.mixed_pool = len(set(self.device_limits)) > 1
        self.outbox: list[EngineEvent] = []   # audit decisions and verdicts since the driver last took them
        self.splits: dict[str, Split] = {}        # incumbent channel -> its running canary
        self._arms: dict[str, tuple[Split, bool]] = {}   # channel -> (its split, whether it is the candidate)
        self.retiring: set[str] = set()           # twins whose canary ended, channels a reload removed: go once empty
        self.channels = channels
        self.devices = [Device(name, DeviceStats(name, since_ns=now_ns), up=[False] * feeders) for name in devices]
        self.inflight = inflight   # a device holds at most (its feeders that are up) + inflight - 1 batches
        self.feeders = feeders     # worker processes a device ([devices] workers_per_device)
        self.lead_ns = queue_lead_ns   # a queued slot opens this early (`SchedulingPasses.counted`)
        self.passes = SchedulingPasses(queue_lead_ns)
        self.pass_clock = pass_clock   # the daemon's: its passes are timed (the simulator's take no time)
        self.cache = cache
        self.freeze = freeze               # turns an output into what the cache may keep
        self.fingerprint = fingerprint     # payload -> identity of its input, for the quarantine
        self.quarantine: OrderedDict[Hashable, None] = OrderedDict()
        self.device_speed: dict[tuple[str, int], float] = {}   # (channel, device) -> time taken / the channel's estimate
        self.warmup_backlog: deque[Job] = deque()
        self.warmup_channel: str | None = None
        self.stopped = False
        self.memory_used = 0.0   # fullest device's memory use (0..1), as last observed (see observe)
        self._keys = 0
        self.polls = 0           # scheduling passes asked of the scheduler (a cost figure)
        self._wakeup: int | None = None
        self._rotated_ns = now_ns
        self._inflight = self._inflight_ns   # (bound once: the scheduler may ask it per request)
        self._inflight_memo: tuple[int, int] | None = None   # (clock reading, `_inflight_ns` then)
    def submit(self, job: Job, now_ns: int) -> Answer | None:
        """Queue `job` (None), or answer it at once: cached, quarantined, overloaded, no device."""
        channel = self.channels[job.channel]
        if self.stopped:
            return Answer(job.payload, P.SHUTTING_DOWN, "daemon is shutting down")
        if self.retiring and job.channel in self.retiring:
            return Answer(job.payload, P.REFUSED, f"channel {job.channel!r} was removed by a reload")
        if self.devices[0].gone and all(d.gone for d in self.devices):
            return Answer(job.payload, P.UNAVAILABLE, "no device is left to run this model; see the daemon's log")
        if channel.settings.isolated and job.tenant is None and not job.warmup:
            if channel.settings.anonymous == "refuse":
                self._isolation(ANONYMOUS_RULE, "refused", job)
                return Answer(job.payload, P.REFUSED, f"rule {ANONYMOUS_RULE}: channel {job.channel!r} is isolated "
                                                      "and the request names no tenant; set the request's tenant")
            self._isolation(ANONYMOUS_RULE, "ran alone", job)
        if (job.cache_key is not None and self.cache is not None and not channel.settings.isolated
                and (job.cache_rule is None or job.cache_rule.lookup)):
            hit = self.cache.get(job.cache_key)
            if hit is not None:
                channel.stats.cache_hits += 1
                return Answer(job.payload, OK, output=hit, timing=P.Timing(0, 0, 0, 0, job.channel, "cache"))
        if self.quarantine and self.fingerprint and self.fingerprint(job.payload) in self.quarantine:
            channel.stats.failed += 1
            return Answer(job.payload, P.MODEL_ERROR, "this input made the model's worker die twice; "
                                                      "it is quarantined until the daemon restarts")
        split = self.splits.get(job.channel) if self.splits and not job.warmup else None
        if split is not None and split.judge.takes_next():
            if split.shadow:
                self._queue(Job(job.model, split.twin, job.tokens, job.deadline_ms, job.payload, job.tenant,
                                shadow=True), now_ns)
            else:
                job.channel, channel = split.twin, self.channels[split.twin]
        if self._queue(job, now_ns):
            return None
        wait = channel.refused_wait_ns
        why = (f"queue is full ({channel.settings.queue_limit})" if wait is None else
               f"backlogged: the predicted wait ({wait / 1e6:.0f} ms) and its own run end past its deadline")
        return Answer(job.payload, P.OVERLOADED, f"channel {job.channel!r} {why}")

    def _queue(self, job: Job, now_ns: int) -> bool:
        """Hand `job` to the scheduler; False: its channel refused it (full, or backlogged past its deadline)."""
        self._keys += 1
        job.key, job.arrival_ns, job.deadline_ns = self._keys, now_ns, now_ns + int(job.deadline_ms * 1e6)
        usable = idle = 0
        for d in self.devices:
            if d.usable:
                usable += 1
                idle = idle or not d.held
        if self.scheduler.submit(job, now_ns, usable, bool(idle), self._inflight):
            return True
        self._judged(job.channel, False, 0, now_ns)
        return False

    def _isolation(self, rule: str, action: str, job: Job) -> None:
        if action == "refused":
            self.channels[job.channel].stats.refused += 1
        self.outbox.append(AuditEvent(rule, action, job))

    def take_events(self) -> Sequence[EngineEvent]:
        """The audit decisions and canary verdicts of the calls since the last take, oldest first, for
        the driver to carry out now that the engine is between calls (see `dynbatchd.engine.events`)."""
        events = self.outbox
        if not events:
            return NO_EVENTS   # the common case: no new list per call on the request path
        self.outbox = []
        return events

    def cancel(self, job: Job, now_ns: int) -> Answer | None:
        """The client withdrew `job`: still queued, it leaves the queue and is answered
        `cancelled`; already dispatched, it is answered when its batch ends (None)."""
        channel = self.channels.get(job.channel)
        if not job.queued or channel is None or channel.withdraw(job) is None:
            return None
        channel.stats.cancelled += 1
        return Answer(job.payload, P.CANCELLED, "cancelled by the client")

    def refused(self, channel: str) -> None:
        """A compliance check refused a request routed to `channel` (counted, never queued)."""
        self.channels[channel].stats.refused += 1

    def count_generated(self, channel: str, counter: str, *, late: bool = False) -> None:
        """A generate request (run by its worker's own step loop, never batched here) counted in
        `channel` beside the engine's own: `counter` is one of `GENERATED_COUNTERS`; `late`: it
        ended ok after its deadline. A channel the engine no longer runs counts nothing."""
        if counter not in GENERATED_COUNTERS:
            raise ValueError(f"not a generate counter: {counter!r}")
        found = self.channels.get(channel)
        if found is not None:
            stats = found.stats
            setattr(stats, counter, getattr(stats, counter) + 1)
            stats.late += late

    def step(self, now_ns: int) -> tuple[list[Dispatch], list[Answer]]:
        """One scheduling pass: answer the hopeless, fill every open device slot."""
        dispatches: list[Dispatch] = []
        answers: list[Answer] = []
        if self.warmup_backlog and not self.stopped:
            self._feed_warmup(now_ns)
        self._wakeup = None
        if self.splits or self.retiring:
            self._review_splits(now_ns)
        if not self.scheduler.depth():
            return dispatches, answers
        began = self.pass_clock() if self.pass_clock is not None else 0
        views = self._views()   # one snapshot, kept current as batches are placed
        while True:   # each placement may open that device's next slot: ask again until none opens
            free, busy = open_slots(views, now_ns, self.inflight, self.lead_ns)
            decision = self.scheduler.poll(now_ns, free, busy)
            self.polls += 1
            for item in decision.expired:
                self._fail(item, P.DEADLINE_EXCEEDED, "deadline passed before the request could run", now_ns, answers)
            placed = 0
            for batch in decision.batches:
                index = self._place(batch, views, now_ns)
                if index is None:
                    self.scheduler.requeue(batch.items)   # a retried request waits for an idle device
                else:
                    device = self.devices[index]   # (`_place` may have cut the batch: the same id, fewer items)
                    dispatches.append(Dispatch(index, device.held[batch.id][0], device.feeder_of[batch.id]))
                    placed += 1
            if not placed:
                break
        wake = self.scheduler.next_wakeup(now_ns, free, busy)
        if self.scheduler.depth():   # a queued slot opening soon is worth waking for
            opening = next_opening_ns(views, now_ns, self.inflight, self.lead_ns)
            if opening is not None:
                wake = opening if wake is None else min(wake, opening)
        self._wakeup = wake
        if dispatches and self.pass_clock is not None:
            self.lead_ns = self.passes.counted(self.pass_clock() - began)
        return dispatches, answers

    def next_wakeup(self) -> int | None:
        """When the last step() wants to run again if nothing else happens first."""
        return self._wakeup

    def completed(self, device: int, batch_id: int, outcome: Outcome, now_ns: int) -> list[Answer]:
        """A device finished a batch: one answer per request (none for warmup, none twice)."""
        dev = self.devices[device]
        entry = dev.held.pop(batch_id, None)
        dev.stats.inflight = len(dev.held)
        dev.exclusive = False
        self._devices_changed()
        if entry is None:
            return []   # already answered: lost, stopped, or a stray message
        feeder = dev.feeder_of.pop(batch_id)
        for bid in dev.held:   # the feeder's batch queued behind it starts now, not when it was sent
            if dev.feeder_of[bid] == feeder:
                queued, sent_ns = dev.held[bid]
                dev.held[bid] = (queued, max(sent_ns, now_ns))
                break
        batch = entry[0]
        n = len(batch.items)
        dev.stats.batches += 1
        dev.stats.items += n
        dev.stats.busy_ns += outcome.compute_ns
        if outcome.prepare_ns:   # a pipelined feeder prepares the next batch while one runs: send it that early
            dev.prepare_ns += 0.2 * (outcome.prepare_ns - dev.prepare_ns) if dev.prepare_ns else outcome.prepare_ns
        cost = self.channels[batch.channel].cost
        expected = cost.estimate_ns(n, batch.tokens)
        if expected > 0 and cost.samples >= 8:   # this device against a settled channel model, over ~20 batches
            key = (batch.channel, device)
            ratio = min(100.0, max(0.01, outcome.compute_ns / expected))
            self.device_speed[key] = self.device_speed.get(key, 1.0) * 0.95 + 0.05 * ratio
        self.scheduler.completed(batch, outcome.compute_ns, now_ns)
        arm = self._arms.get(batch.channel) if self._arms else None
        if arm is not None:
            arm[0].judge.record_batch(arm[1], outcome.compute_ns)
        if outcome.oom:
            self._out_of_memory(device, batch)
        answers: list[Answer] = []
        if outcome.problem:
            for item in batch.items:
                self._fail(item, P.MODEL_ERROR, f"the model's worker answered badly: {outcome.problem}", now_ns, answers)
            return answers
        channel = self.channels[batch.channel]
        stats, latencies = channel.stats, []
        cache = self.cache if not channel.settings.isolated else None   # regulated data is never cached
        errors, outputs, rejected = outcome.errors, outcome.outputs, set(outcome.rejected)
        compute_us = outcome.compute_ns // 1000
        late = 0
        for i, job in enumerate(batch.items):   # (each item is its Job)
            if errors and i in errors:
                self._fail(job, P.BAD_REQUEST if i in rejected else P.MODEL_ERROR, errors[i], now_ns, answers)
                continue
            output = outputs[i] if outputs is not None else None
            if cache is not None and job.cache_key is not None:
                cache.put(job.cache_key, self.freeze(output),
                          "always" if job.warmup else job.cache_rule.store if job.cache_rule else "filter")
            if job.warmup:
                continue
            if arm is not None:   # a canary's arm: each request's outcome goes to its judge
                self._judged(batch.channel, now_ns <= job.deadline_ns, now_ns - job.arrival_ns, now_ns)
            total_us = (now_ns - job.arrival_ns) // 1000   # queue: all of it but compute (hand-over included)
            if now_ns > job.deadline_ns:
                late += 1
            latencies.append(total_us)
            if not job.shadow:   # a canary's copy: judged, never answered
                answers.append(Answer(job.payload, OK, output=output, timing=P.Timing(
                    max(0, total_us - compute_us), compute_us, total_us, n, batch.channel, dev.name, outcome.simulated)))
        stats.completed += len(latencies)
        stats.late += late
        stats.latency.record_all(latencies)
        return answers

    def observe(self, now_ns: int, utilisation: float, memory: float, *, memory_used: float | None = None) -> None:
        """Once a second or so: tell every channel's batch sizer what the devices are doing.
        `memory` is what the daemon's batches need (for the sizers); `memory_used`, the fullest
        device's whole memory use (NVML's, for the health score), kept as `memory_used` when given."""
        if memory_used is not None:
            self.memory_used = memory_used
        for channel in self.channels.values():
            channel.sizer.observe(utilisation=utilisation, memory=memory, queue_len=channel.depth, now_ns=now_ns)
        if now_ns - self._rotated_ns >= LATENCY_PERIOD_NS:
            self._rotated_ns = now_ns
            for channel in self.channels.values():
                channel.stats.latency.rotate()

    def drain(self) -> None:
        """Stop waiting for fuller batches, and drop the optional warmup work."""
        self.warmup_backlog.clear()
        self.scheduler.drain()

    def busy(self) -> bool:
        return bool(self.scheduler.depth() or any(d.held for d in self.devices))

    def stop(self, now_ns: int) -> list[Answer]:
        """Answer everything still queued or running `shutting_down`; any later result is ignored."""
        self.stopped = True
        answers: list[Answer] = []
        for item in self.scheduler.take_all():
            self._fail(item, P.SHUTTING_DOWN, "daemon stopped before this request could run", now_ns, answers)
        for dev in self.devices:
            for batch, _ in dev.held.values():
                for item in batch.items:
                    self._fail(item, P.SHUTTING_DOWN, "daemon stopped while this request was running", now_ns, answers)
            dev.held.clear()
            dev.feeder_of.clear()
            dev.stats.inflight = 0
        self._devices_changed()
        return answers
    def _fail(self, job: Job, code: str, message: str, now_ns: int, out: list[Answer]) -> None:
        if job.warmup:   # nobody waits for it
            return
        self._judged(job.channel, False, now_ns - job.arrival_ns, now_ns)   # a miss (a cancel never comes here)
        stats = self.channels[job.channel].stats
        if code != P.DEADLINE_EXCEEDED:   # expiries are counted where the scheduler expires them
            stats.failed += 1
        stats.latency.record((now_ns - job.arrival_ns) // 1000)
        if not job.shadow:
            out.append(Answer(job.payload, code, message))

    def snapshot(self, now_ns: int) -> dict[str, Any]:
        return {"channels": self.scheduler.snapshot(now_ns),
                "devices": [{**d.stats.snapshot(now_ns), "cpu_stage_ms": round(d.prepare_ns / 1e6, 3),
                             "batch_limit": {"items": items, "tokens": tokens, "source": self.limit_sources[i]}}
                            for i, (d, (items, tokens)) in enumerate(zip(self.devices, self.device_limits))],
                "quarantined": len(self.quarantine),
                "warmup_backlog": len(self.warmup_backlog),
                "deadlines_ms": {name: c.settings.deadline_ms for name, c in self.channels.items()},   # a twin's too
                "memory_used": self.memory_used,   # the fullest device's, for the health score
                "polls": self.polls, "scheduling": self.passes.snapshot()}
