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

A device may be fed by several worker processes (`feeders`, [devices]
workers_per_device): the engine still sees one device, with one memory and
one speed, and places each batch on the device first, then on its
least-loaded feeder that is up (`Dispatch.feeder`). A feeder that dies costs
only its own batches; the device serves while any feeder is up.

No sockets, threads, asyncio or clocks here: the live daemon
(`dynbatchd.service`) and the discrete-event simulator (`dynbatchd.simulate`)
make the same decisions because they call the same methods. A job's
`payload` is the driver's own business (a reply address, a trace index);
the engine hands it back in every Dispatch and Answer.
"""

from __future__ import annotations

import copy
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Sequence

from dynbatchd import protocol as P
from dynbatchd.scheduler import Batch, Channel, Item, Scheduler
from dynbatchd.scheduler.slots import DeviceView, estimated_free_at, next_opening_ns, open_slots, pick_device
from dynbatchd.telemetry import DeviceStats

OK = "ok"
ANONYMOUS_RULE = "isolated-needs-tenant"   # an isolated channel's request without a tenant
MAX_RETRIES = 1              # a request whose worker died under it runs once more, alone
SUSPECT_FACTOR = 10          # a retried request alone is hung after this many times its estimate...
SUSPECT_FLOOR_NS = 10**9     # ...but never before this
QUARANTINE_SIZE = 4096       # fingerprints of inputs proven to kill a worker
WARMUP_DEADLINE_NS = 3_600 * 10**9   # warmup is never urgent and never answered
LATENCY_PERIOD_NS = 30 * 10**9       # status shows the last 30-60 s of latency


class Job(Item):
    """One request as the engine holds it, and the scheduler's queue item itself: a request is one
    object from submit to answer, however far it goes. `payload` is the driver's own (a reply
    address, a trace index), handed back in every answer; `key`, `arrival_ns` and `deadline_ns`
    are set when it is queued (`key` 0: never queued)."""
    __slots__ = ("deadline_ms", "cache_key", "cache_rule", "shadow")

    def __init__(self, model: str, channel: str, tokens: int, deadline_ms: float, payload: Any = None,
                 tenant: str | None = None, cache_key: Hashable | None = None, cache_rule: Any = None,
                 warmup: bool = False, shadow: bool = False):
        # (assigned here, not through Item's __init__: this runs once per request)
        self.key, self.arrival_ns, self.deadline_ns, self.retries, self.queued = 0, 0, 0, 0, False
        self.model, self.channel, self.tokens, self.tenant, self.payload = model, channel, tokens, tenant, payload
        self.deadline_ms = deadline_ms
        self.cache_key = cache_key     # None: never served from or stored in the cache
        self.cache_rule = cache_rule   # the cache policy's CacheRule; None: looked up, stored by frequency
        self.warmup = warmup           # nobody waits for it; its result only fills the cache
        self.shadow = shadow           # a copy run under a canary's settings: judged, never answered


@dataclass(slots=True)
class Answer:
    """What the driver sends back for one request: code OK with an output, or an error."""
    payload: Any
    code: str
    message: str = ""
    output: Any = None
    timing: P.Timing | None = None


@dataclass(slots=True)
class Dispatch:
    device: int
    batch: Batch
    feeder: int = 0   # which of the device's worker processes takes it


@dataclass(slots=True)
class Outcome:
    """What a device made of one batch: per-item outputs, or per-item errors."""
    compute_ns: int
    outputs: list[Any] | None = None
    errors: dict[int, str] = field(default_factory=dict)
    rejected: Iterable[int] = ()   # errors that are the client's input's fault: bad_request
    oom: bool = False
    simulated: bool = False
    problem: str | None = None     # the device answered in a way that cannot be split: all fail
    prepare_ns: int = 0            # the worker's CPU stage before the device ran it (0: not measured)


@dataclass(slots=True, eq=False)
class Split:
    """A channel's traffic shared with a twin channel that runs candidate settings (a live canary).

    `judge` (see `dynbatchd.tuning.canary.Canary`) says which requests the twin takes and, from
    what each side did, when to stop: ``takes_next()``, ``record(candidate, on_time, latency_ns)``,
    ``record_batch(candidate, device_ns)``, ``decide(now_ns) -> verdict | None``. With `shadow`,
    the twin runs copies of the requests it takes and nobody gets their results."""
    channel: str
    twin: str
    judge: Any
    shadow: bool = False
    verdict: Any = None


@dataclass(slots=True)
class Loss:
    answers: list[Answer]
    explained: bool   # the death was a proven poison input's, not the device's


@dataclass(slots=True, eq=False)
class Device:
    """One device in the table: what it holds and what it has done."""
    name: str
    stats: DeviceStats
    usable: bool = False        # some feeder of it is up (and it is not given up)
    exclusive: bool = False     # running a retried request alone: takes nothing else meanwhile
    gone: bool = False          # given up: nothing goes there until a probe of it comes up
    hung: set[int] = field(default_factory=set)   # batches the watchdog found hung (their feeders are being killed)
    # batch id -> (batch, when it started or was sent), in send order; a feeder's next batch is timed
    # from when its batch ahead ends, so the device's estimated end is right and hung counts from its start
    held: dict[int, tuple[Batch, int]] = field(default_factory=dict)
    up: list[bool] = field(default_factory=lambda: [False])   # by feeder: its worker process serves
    feeder_of: dict[int, int] = field(default_factory=dict)   # held batch id -> the feeder it was sent to
    prepare_ns: float = 0.0   # a feeder's CPU stage before a batch reaches the device, recently (decayed)

    def feeder_batches(self, feeder: int) -> list[int]:
        """The ids of the batches `feeder` holds, in the order sent (its first is running)."""
        return [bid for bid in self.held if self.feeder_of[bid] == feeder]

    def least_loaded(self) -> int:
        """The feeder that is up and holds the fewest batches (the lowest on a tie)."""
        load = [0] * len(self.up)
        for feeder in self.feeder_of.values():
            load[feeder] += 1
        return min((f for f, up in enumerate(self.up) if up), key=load.__getitem__)


class Engine:
    def __init__(self, channels: dict[str, Channel], devices: list[str], *, inflight: int = 2, feeders: int = 1,
                 queue_lead_ns: int = 1_000_000, cache: Any = None, freeze: Callable[[Any], Any] = lambda o: o,
                 fingerprint: Callable[[Any], Hashable] | None = None, now_ns: int = 0,
                 on_isolation: Callable[[str, str, "Job"], None] | None = None,
                 device_limits: Sequence[tuple[int, int]] | None = None,
                 on_verdict: Callable[[Split], None] | None = None):
        self.scheduler = Scheduler(channels)
        # (most items, most tokens) one batch may carry on each device (0: no limit): a mixed pool's
        # smaller device gets a batch cut to its own size, the rest waits for the next device.
        # An entry may add where the limit came from (items, tokens, "config" / "NVML" / "runner"), for status.
        self.device_limits = [(lim[0], lim[1]) for lim in device_limits] if device_limits else [(0, 0)] * len(devices)
        self.limit_sources = [lim[2] if len(lim) > 2 else "runner" if any(lim) else ""
                              for lim in device_limits] if device_limits else [""] * len(devices)
        # devices of different sizes learn an out-of-memory each for itself; alike, the channel's sizer does
        self.mixed_pool = len(set(self.device_limits)) > 1
        self.on_isolation = on_isolation   # (rule, action, job): an isolation decision, for the audit trail
        self.on_verdict = on_verdict       # a canary's split ended (its verdict is on the Split)
        self.splits: dict[str, Split] = {}        # incumbent channel -> its running canary
        self._arms: dict[str, tuple[Split, bool]] = {}   # channel -> (its split, whether it is the candidate)
        self.retiring: set[str] = set()           # twins whose canary ended, channels a reload removed: go once empty
        self.channels = channels
        self.devices = [Device(name, DeviceStats(name, since_ns=now_ns), up=[False] * feeders) for name in devices]
        self.inflight = inflight   # a device holds at most (its feeders that are up) + inflight - 1 batches
        self.feeders = feeders     # worker processes a device ([devices] workers_per_device)
        self.lead_ns = queue_lead_ns
        self.cache = cache
        self.freeze = freeze               # turns an output into what the cache may keep
        self.fingerprint = fingerprint     # payload -> identity of its input, for the quarantine
        self.quarantine: OrderedDict[Hashable, None] = OrderedDict()
        self.device_speed: dict[tuple[str, int], float] = {}   # (channel, device) -> time taken / the channel's estimate
        self.warmup_backlog: deque[Job] = deque()
        self.warmup_channel: str | None = None
        self.stopped = False
        self.memory_used = 0.0   # fullest device's memory use (0..1), as last observed
        self._keys = 0
        self.polls = 0           # scheduling passes asked of the scheduler (a cost figure)
        self._wakeup: int | None = None
        self._rotated_ns = now_ns
        self._inflight = self._inflight_ns   # (bound once: the scheduler may ask it per request)

    # -- requests -----------------------------------------------------------
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
        if self.on_isolation is not None:
            self.on_isolation(rule, action, job)

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

    def add_warmup(self, jobs: Iterable[Job], channel: str) -> tuple[int, int]:
        """Queue warmup jobs not cached yet, to be fed a little at a time; (queued, already cached)."""
        self.warmup_channel = channel
        queued = cached = 0
        for job in jobs:
            if self.cache is not None and job.cache_key in self.cache:
                cached += 1
            else:
                job.channel, job.warmup, job.deadline_ms = channel, True, WARMUP_DEADLINE_NS / 1e6
                self.warmup_backlog.append(job)
                queued += 1
        return queued, cached

    def forget_warmup(self, keys: set) -> int:
        """Drop the warmup inputs whose cache key is in `keys` from the backlog (how many); those
        already queued or running still run, but their results are not kept."""
        before = len(self.warmup_backlog)
        self.warmup_backlog = deque(job for job in self.warmup_backlog if job.cache_key not in keys)
        fed = [entry[2] for channel in self.channels.values() for lane in channel.lanes.values() if lane.warmup
               for entry in lane.heap]
        fed += [job for device in self.devices for batch, _ in device.held.values() for job in batch.items]
        for job in fed:
            if job.warmup and job.cache_key in keys:
                job.cache_key = None
        return before - len(self.warmup_backlog)

    def _feed_warmup(self, now_ns: int) -> None:
        """Top the warmup channel up to half its queue, so warmup never crowds live traffic out."""
        channel = self.channels[self.warmup_channel]
        room = channel.settings.queue_limit // 2 - channel.depth
        while room > 0 and self.warmup_backlog:
            job = self.warmup_backlog.popleft()
            self._keys += 1
            job.key, job.arrival_ns, job.deadline_ns = self._keys, now_ns, now_ns + WARMUP_DEADLINE_NS
            self.scheduler.submit(job, now_ns)
            room -= 1

    # -- scheduling -----------------------------------------------------------
    def _estimate(self, batch: Batch, device: int | None = None) -> int:
        """A batch's compute time: as the channel learned it over every device, times what `device`
        learned of itself (a pool may mix devices of different speeds)."""
        base = self.channels[batch.channel].cost.estimate_ns(len(batch.items), batch.tokens)
        return base if device is None else int(base * self.device_speed.get((batch.channel, device), 1.0))

    def _inflight_ns(self, now_ns: int) -> int:
        """Device time the usable devices still have to run of the batches they hold (estimated):
        a request queued now waits for it before anything queued. Asked only when the scheduler
        predicts a wait (a backlog on busy devices)."""
        total = 0
        for i, d in enumerate(self.devices):
            if d.usable and d.held:
                total += max(0, estimated_free_at(d.held.values(), lambda b, i=i: self._estimate(b, i)) - now_ns)
        return total

    def _views(self) -> list[DeviceView]:
        return [DeviceView(len(d.held), estimated_free_at(d.held.values(), lambda b, i=i: self._estimate(b, i)),
                           d.usable and not d.exclusive, sum(d.up), int(d.prepare_ns)) for i, d in enumerate(self.devices)]

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
        return dispatches, answers

    def _place(self, batch: Batch, views: list[DeviceView], now_ns: int) -> int | None:
        """The open device on which `batch` would finish soonest (by each device's learned cost;
        fewest held on a tie), and there its least-loaded feeder. A retried request goes only to
        an idle device (every feeder idle) and runs there alone: if it kills its feeder too, it
        is certainly the cause."""
        exclusive = any(item.retries for item in batch.items)
        choose = [DeviceView(v.held, v.free_at_ns, v.usable and v.held == 0, v.feeders, v.lead_ns)
                  for v in views] if exclusive else views
        index = pick_device(choose, now_ns, self.inflight, self.lead_ns, lambda i: self._estimate(batch, i))
        if index is None:
            return None
        batch = self._fit(batch, index)
        view = views[index]
        end = (max(view.free_at_ns, now_ns) if view.held else now_ns) + self._estimate(batch, index)
        device = self.devices[index]
        device.feeder_of[batch.id] = device.least_loaded()
        device.held[batch.id] = (batch, now_ns)
        device.exclusive = exclusive
        device.stats.inflight = len(device.held)
        views[index] = DeviceView(view.held + 1, end, view.usable and not exclusive, view.feeders, view.lead_ns)
        return index

    def _fit(self, batch: Batch, index: int) -> Batch:
        """`batch` cut to what device `index` holds (its first items, in the scheduler's order); the
        rest goes back to the queue for the next device."""
        most_items, most_tokens = self.device_limits[index]
        if not most_items and not most_tokens:
            return batch
        keep, tokens = 0, 0
        for item in batch.items:
            if keep and ((most_items and keep >= most_items) or (most_tokens and tokens + item.tokens > most_tokens)):
                break
            keep, tokens = keep + 1, tokens + item.tokens
        if keep == len(batch.items):
            return batch
        self.scheduler.requeue(batch.items[keep:])
        return Batch(batch.id, batch.channel, batch.model, batch.items[:keep], batch.formed_ns,
                     min(batch.max_batch, most_items or batch.max_batch), tokens)

    def next_wakeup(self) -> int | None:
        """When the last step() wants to run again if nothing else happens first."""
        return self._wakeup

    # -- canaries -----------------------------------------------------------------
    def start_split(self, channel: str, twin: Channel, judge: Any, *, shadow: bool = False) -> Split:
        """Share `channel`'s traffic with `twin` (the candidate's settings) as `judge` says, until it
        decides; the twin starts with what the channel has learned of its cost on each device."""
        if self.splits:
            raise ValueError(f"a canary of channel {next(iter(self.splits))!r} is already running")
        if twin.name in self.channels:
            raise ValueError(f"channel {twin.name!r} still exists (a canary that ended is still draining)")
        incumbent = self.channels[channel]
        twin.cost = copy.deepcopy(incumbent.cost)
        for (name, device), speed in list(self.device_speed.items()):
            if name == channel:
                self.device_speed[(twin.name, device)] = speed
        self.scheduler.add_channel(twin)
        split = self.splits[channel] = Split(channel, twin.name, judge, shadow)
        self._arms[channel], self._arms[twin.name] = (split, False), (split, True)
        return split

    def end_split(self, channel: str, verdict: Any) -> Split | None:
        """Stop sharing `channel`'s traffic (the judge's verdict, or an operator's); what the twin
        holds still runs there, and the twin is removed once it is empty."""
        split = self.splits.pop(channel, None)
        if split is None:
            return None
        split.verdict = verdict
        self._arms.pop(split.channel, None)
        self._arms.pop(split.twin, None)
        self.retiring.add(split.twin)
        if self.on_verdict is not None:
            self.on_verdict(split)
        return split

    # -- channels and models a reload adds or removes ------------------------------
    def add_channel(self, channel: Channel) -> None:
        """A channel a reload added: routable at once. One still draining after an earlier removal
        is taken back with the new settings and keeps its queue."""
        if channel.name in self.channels:
            self.retiring.discard(channel.name)
            self.channels[channel.name].retune(channel.settings, channel)
            return
        self.scheduler.add_channel(channel)

    def retire_channel(self, name: str) -> None:
        """A channel a reload removed: it takes no new request (submit refuses one), what it holds
        is answered as usual, and step() then drops it (as it drops an ended canary's twin)."""
        if name in self.channels:
            self.retiring.add(name)
        if name == self.warmup_channel:   # warmup is optional work: its backlog goes with the channel
            self.warmup_backlog.clear()
            self.warmup_channel = None

    def holds_model(self, model: str) -> bool:
        """Whether a request for `model` is still queued, running or in the warmup backlog: a model
        a reload removed is unloaded from the devices only once none is."""
        if any(job.model == model for job in self.warmup_backlog):
            return True
        if any(lane.model == model and lane.heap for channel in self.channels.values()
               for lane in channel.lanes.values()):
            return True
        return any(batch.model == model for d in self.devices for batch, _ in d.held.values())

    def set_device_limits(self, limits: Sequence[tuple[int, ...]]) -> None:
        """Each device's batch limit again, after a reload changed the models it holds (sized per device)."""
        self.device_limits = [(lim[0], lim[1]) for lim in limits]
        self.limit_sources = [lim[2] if len(lim) > 2 else "runner" if any(lim) else "" for lim in limits]
        self.mixed_pool = len(set(self.device_limits)) > 1

    def _judged(self, channel: str, on_time: bool, latency_ns: int, now_ns: int) -> None:
        arm = self._arms.get(channel) if self._arms else None
        if arm is None:
            return
        split, candidate = arm
        split.judge.record(candidate, on_time, latency_ns)
        verdict = split.judge.decide(now_ns)
        if verdict is not None:
            self.end_split(split.channel, verdict)

    def _review_splits(self, now_ns: int) -> None:
        """A canary whose time is up ends even without traffic; an ended twin goes once empty."""
        for split in list(self.splits.values()):
            verdict = split.judge.decide(now_ns)
            if verdict is not None:
                self.end_split(split.channel, verdict)
        for twin in list(self.retiring):
            if not self.channels[twin].depth and not any(b.channel == twin for d in self.devices
                                                          for b, _ in d.held.values()):
                self.retiring.discard(twin)
                self.scheduler.remove_channel(twin)
                for key in [k for k in self.device_speed if k[0] == twin]:
                    del self.device_speed[key]

    # -- device events ----------------------------------------------------------
    def device_up(self, device: int, feeder: int = 0) -> None:
        """A feeder of `device` came up (started, restarted, or a probe of a given-up device)."""
        d = self.devices[device]
        d.up[feeder] = True
        d.usable, d.gone = True, False
        d.exclusive = d.exclusive and bool(d.held)   # another feeder may still run a retried request alone

    def device_gone(self, device: int, now_ns: int) -> list[Answer]:
        """A device is given up (no feeder of it is left); with none left, everything queued is
        answered unavailable."""
        d = self.devices[device]
        d.usable, d.gone, d.up = False, True, [False] * len(d.up)
        if not all(d.gone for d in self.devices):
            return []
        answers: list[Answer] = []
        for item in self.scheduler.take_all():
            self._fail(item, P.UNAVAILABLE, "no device is left to run this model; see the daemon's log", now_ns, answers)
        return answers

    def completed(self, device: int, batch_id: int, outcome: Outcome, now_ns: int) -> list[Answer]:
        """A device finished a batch: one answer per request (none for warmup, none twice)."""
        dev = self.devices[device]
        entry = dev.held.pop(batch_id, None)
        dev.stats.inflight = len(dev.held)
        dev.exclusive = False
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

    def _out_of_memory(self, device: int, batch: Batch) -> None:
        """A batch did not fit on `device`. In a mixed pool that device's own item limit halves (as
        the worker's bisection did), leaving the bigger devices' batches alone; in a pool of alike
        devices the channel's sizer shrinks the batches for all of them."""
        if not self.mixed_pool:
            self.scheduler.out_of_memory(batch)
            return
        items, tokens = self.device_limits[device]
        self.device_limits[device] = (max(1, min(items or len(batch.items), len(batch.items) // 2)), tokens)
        self.limit_sources[device] = "learned after OOM"

    def lost(self, device: int, now_ns: int, feeder: int = 0) -> Loss:
        """A feeder of a device (its worker process) died. What it was running runs once more,
        alone; a request that kills a feeder a second time is proven poison: answered, and its
        input quarantined. So is one that hung alone (the watchdog killed its feeder, see
        overdue()): it needs no second period to prove it. What was only waiting behind it is
        requeued as it was. A feeder that pipelines (it reports a CPU stage) prepares its next
        batch while one runs, so that one is a suspect too. The device's other feeders keep what
        they hold and keep serving."""
        dev = self.devices[device]
        ids = dev.feeder_batches(feeder)   # in the order sent: the first was running
        held = [dev.held.pop(bid)[0] for bid in ids]
        for bid in ids:
            del dev.feeder_of[bid]
        hung = bool(held) and held[0].id in dev.hung
        dev.hung.difference_update(ids)
        dev.stats.inflight = len(dev.held)
        dev.up[feeder] = False
        dev.usable = any(dev.up) and not dev.gone
        dev.exclusive = dev.exclusive and bool(dev.held)
        answers: list[Answer] = []
        retry: list[Item] = []
        explained = False
        suspects = held[:1] if hung or not dev.prepare_ns else held[:2]
        running = [item for batch in suspects for item in batch.items]
        alone = hung and len(running) == 1
        for item in running:
            if item.retries < MAX_RETRIES and not alone:
                item.retries += 1
                retry.append(item)
                continue
            explained = True
            if self.fingerprint is not None:
                self.quarantine[self.fingerprint(item.payload)] = None
                while len(self.quarantine) > QUARANTINE_SIZE:
                    self.quarantine.popitem(last=False)
            why = "hung while running this request alone" if alone else "died twice while running this request"
            self._fail(item, P.MODEL_ERROR, f"the worker for {dev.name} {why}; its input is quarantined",
                       now_ns, answers)
        retry.extend(item for batch in held[len(suspects):] for item in batch.items)
        if self.stopped:
            for item in retry:
                self._fail(item, P.SHUTTING_DOWN, "daemon stopped while this request was running", now_ns, answers)
        else:
            self.scheduler.requeue(retry)
        return Loss(answers, explained)

    def unsendable(self, device: int, batch_id: int, bad: dict[int, str], now_ns: int) -> list[Answer]:
        """A dispatched batch could not be encoded for its worker. Its inputs that cannot be
        encoded even alone (`bad`: index -> why) are the client's fault, answered bad_request; the
        rest go back to the queue as they were. With none bad alone, the whole batch is answered
        model_error. Either way its device slot is free at once: nothing waits for a batch that
        was never sent."""
        dev = self.devices[device]
        entry = dev.held.pop(batch_id, None)
        dev.feeder_of.pop(batch_id, None)
        dev.stats.inflight = len(dev.held)
        if not dev.held:
            dev.exclusive = False
        answers: list[Answer] = []
        if entry is None:
            return answers
        keep = []
        for i, item in enumerate(entry[0].items):
            if i in bad:
                self._fail(item, P.BAD_REQUEST, f"this input cannot be encoded for the model's worker ({bad[i]})",
                           now_ns, answers)
            elif not bad:
                self._fail(item, P.MODEL_ERROR, "this request's batch could not be sent to the model's worker",
                           now_ns, answers)
            else:
                keep.append(item)
        self.scheduler.requeue(keep)
        return answers

    def undelivered(self, device: int, batch_id: int) -> None:
        """A dispatched batch could not be sent (its feeder vanished): it waits for another feeder
        or device, and that feeder takes nothing more until it is up again (lost() follows)."""
        dev = self.devices[device]
        entry = dev.held.pop(batch_id, None)
        dev.stats.inflight = len(dev.held)
        if entry is not None:
            dev.up[dev.feeder_of.pop(batch_id)] = False
            dev.usable = any(dev.up) and not dev.gone
            dev.exclusive = dev.exclusive and bool(dev.held)
            self.scheduler.requeue(entry[0].items)

    def overdue(self, now_ns: int, timeout_ns: int) -> list[tuple[int, int, int]]:
        """(device, feeder, limit) for each feeder whose running batch (its first held) has run past
        its limit: hung, to be killed; lost() then knows it hung. The limit is `timeout_ns`, except for a retried request
        running alone once its channel's cost is learned: SUSPECT_FACTOR times its estimate, at
        least SUSPECT_FLOOR_NS. So after a batch hangs, its requests rerun alone and the one that
        hangs again is found in a fraction of a second period, while the rest are answered."""
        out = []
        for i, d in enumerate(self.devices):
            running: dict[int, int] = {}   # feeder -> its running batch: the first it holds
            for bid in d.held:
                running.setdefault(d.feeder_of[bid], bid)
            for feeder, bid in running.items():
                batch, started = d.held[bid]
                limit = timeout_ns
                if any(item.retries for item in batch.items) and self.channels[batch.channel].cost.samples:
                    limit = min(timeout_ns, max(SUSPECT_FLOOR_NS, SUSPECT_FACTOR * self._estimate(batch, i)))
                if now_ns - started > limit:
                    d.hung.add(bid)
                    out.append((i, feeder, limit))
        return out

    def observe(self, now_ns: int, utilisation: float, memory: float) -> None:
        """Once a second or so: tell every channel's batch sizer what the devices are doing."""
        for channel in self.channels.values():
            channel.sizer.observe(utilisation=utilisation, memory=memory, queue_len=channel.depth, now_ns=now_ns)
        if now_ns - self._rotated_ns >= LATENCY_PERIOD_NS:
            self._rotated_ns = now_ns
            for channel in self.channels.values():
                channel.stats.latency.rotate()

    # -- stopping -------------------------------------------------------------------
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
        return answers

    # -- accounting -------------------------------------------------------------------
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
                "warmup_backlog": len(self.warmup_backlog)}
