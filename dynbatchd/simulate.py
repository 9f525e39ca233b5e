"""Discrete-event simulation of dynbatchd on simulated accelerators.

The *real* scheduler (``dynbatchd.scheduler``: channels, window plugins,
batch sizers, earliest-deadline dispatch) runs against a virtual clock in
integer nanoseconds. Only the transport and the devices are replaced: each
simulated device runs the batches it holds one after another, taking
``base_ms + per_item_ms·n + per_token_ms·tokens`` per batch (the latency model
of ``devices.runners.SimulatedRunner``), and holds at most ``inflight``
batches, as a live worker does. The loop mirrors ``service.Daemon``: route,
submit (full queue -> ``overloaded``), poll with the free device slots,
answer the expired (``deadline_exceeded``), dispatch through the same slot
rules (``dynbatchd.scheduler.slots``), report each finished batch to
``Scheduler.completed`` (and ``out_of_memory`` after an OOM), and sleep until
the next arrival, completion or ``Scheduler.next_wakeup``.

A batch that exceeds the simulated memory limit is split in halves and
retried on the same device, exactly as the worker's bisection does; a
single request that cannot fit is answered ``model_error``. Every request is
answered exactly once; the simulator checks this and raises if not.

Every figure this module produces comes from a model of a device, not from
hardware: reports label it SIMULATED.

    >>> from dynbatchd.config import ChannelSettings
    >>> r = simulate({"standard": ChannelSettings(max_batch=32, window_ms=10)},
    ...              [(0, 100, "standard")] * 64)
    >>> [b.end_ns for b in r.batches]
    [24000000, 48000000]
"""

from __future__ import annotations

import bisect
import csv
import heapq
import math
from dataclasses import dataclass
from datetime import datetime
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Mapping, Sequence

from dynbatchd.hookspecs import RequestInfo
from dynbatchd.scheduler import Item, Scheduler, build_channels
from dynbatchd.scheduler.slots import DeviceView, next_opening_ns, open_slots, pick_device

MS = 1_000_000
NEVER = 1 << 62

# Outcomes, as the protocol's reply codes name them.
PENDING, COMPLETED, EXPIRED, OVERLOADED, FAILED = 0, 1, 2, 3, 4
OUTCOME_NAMES = {COMPLETED: "completed", EXPIRED: "deadline_exceeded", OVERLOADED: "overloaded",
                 FAILED: "model_error"}


class SimulationError(AssertionError):
    """The simulated daemon broke an invariant (a request answered twice or never)."""


@dataclass(frozen=True, slots=True)
class DeviceModel:
    """One simulated accelerator: the latency model and memory limit of SimulatedRunner."""
    base_ms: float = 8.0
    per_item_ms: float = 0.5
    per_token_ms: float = 0.0
    memory_items: int = 0      # a batch of more items raises OOM (0: no limit)
    memory_tokens: int = 0     # a batch of more tokens raises OOM (0: no limit)
    oom_ms: float = 0.0        # device time a failed (OOM) attempt wastes

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "DeviceModel":
        """The same option names as ``[models.X] runner = "simulated"`` takes."""
        return cls(float(options.get("base_ms", 8.0)), float(options.get("per_item_ms", 0.5)),
                   float(options.get("per_token_ms", 0.0)), int(options.get("memory_items", 0)),
                   int(options.get("memory_tokens", 0)), float(options.get("oom_ms", 0.0)))

    def options(self) -> dict[str, Any]:
        """Options for a live ``simulated`` runner with this model."""
        out: dict[str, Any] = {"base_ms": self.base_ms, "per_item_ms": self.per_item_ms,
                               "per_token_ms": self.per_token_ms}
        if self.memory_items:
            out["memory_items"] = self.memory_items
        if self.memory_tokens:
            out["memory_tokens"] = self.memory_tokens
        return out

    def latency_ns(self, size: int, tokens: int) -> int:
        return round((self.base_ms + self.per_item_ms * size + self.per_token_ms * tokens) * MS)

    def fits(self, size: int, tokens: int) -> bool:
        return not ((self.memory_items and size > self.memory_items)
                    or (self.memory_tokens and tokens > self.memory_tokens))

    def memory_fraction(self, size: int, tokens: int) -> float:
        """How full a batch of this shape makes the device (0 when there is no limit)."""
        parts = []
        if self.memory_items:
            parts.append(size / self.memory_items)
        if self.memory_tokens:
            parts.append(tokens / self.memory_tokens)
        return max(parts, default=0.0)

    def capacity_rps(self, batch: int, tokens_per_item: float = 0.0) -> float:
        """Requests per second one device sustains with full batches of `batch`."""
        return batch * 1e9 / self.latency_ns(batch, round(batch * tokens_per_item))


@dataclass(slots=True)
class Arrival:
    """One request of a trace. `channel` set: it goes there; else routing decides."""
    at_ns: int
    tokens: int = 0
    channel: str | None = None
    tags: tuple[str, ...] = ()
    tenant: str | None = None
    model: str = "sim"
    deadline_ms: float | None = None   # None: the channel's deadline
    slo_ms: float | None = None        # what counts as on time; None: the deadline
    label: str | None = None           # class for reports; None: the channel
    request_type: str | None = None
    user_frequency: str | None = None
    priority: int | None = None


def read_trace_csv(path: Any) -> list[tuple[float, int]]:
    """(seconds since the first request, tokens) per row of a CSV with TIMESTAMP and
    ContextTokens columns (the Azure LLM inference trace format), in time order."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            # "2023-11-16 18:15:46.6805900": seven fractional digits, more than datetime takes
            stamp, _, frac = row["TIMESTAMP"].partition(".")
            at = datetime.fromisoformat(stamp).timestamp() + (float("0." + frac) if frac else 0.0)
            rows.append((at, int(row["ContextTokens"])))
    rows.sort()
    t0 = rows[0][0] if rows else 0.0
    return [(t - t0, tokens) for t, tokens in rows]


def as_arrival(entry: Any) -> Arrival:
    """An Arrival from an Arrival, or from ``(time_ns, tokens, channel-or-metadata)``."""
    if isinstance(entry, Arrival):
        return entry
    at, tokens, *rest = entry
    meta = rest[0] if rest else None
    if meta is None or isinstance(meta, str):
        return Arrival(int(at), int(tokens), meta)
    meta = dict(meta)
    if "tags" in meta:
        meta["tags"] = tuple(meta["tags"])
    return Arrival(int(at), int(tokens), **meta)


@dataclass(slots=True)
class BatchRecord:
    """One batch as the simulated device ran it."""
    id: int
    channel: str
    device: int
    size: int
    tokens: int
    formed_ns: int
    start_ns: int
    end_ns: int
    compute_ns: int
    max_batch: int
    oom: bool = False
    tenants: tuple = ()


@dataclass(slots=True)
class GroupStats:
    """Outcomes of one class (or channel) of requests over a span of arrival times."""
    offered: int = 0
    completed: int = 0
    on_time: int = 0
    late: int = 0
    expired: int = 0
    overloaded: int = 0
    failed: int = 0
    span_s: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    p99_completed_ms: float = 0.0
    p99_success_ms: float = 0.0     # a request not completed counts as +inf: dropping cannot improve it
    max_ms: float = 0.0

    @property
    def goodput_rps(self) -> float:
        """Requests answered successfully within their SLO, per second of the span."""
        return self.on_time / self.span_s if self.span_s > 0 else 0.0

    @property
    def on_time_fraction(self) -> float:
        """On-time completions over everything offered (overloaded and expired count as misses)."""
        return self.on_time / self.offered if self.offered else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {"offered": self.offered, "completed": self.completed, "on_time": self.on_time,
                "late": self.late, "expired": self.expired, "overloaded": self.overloaded,
                "failed": self.failed, "goodput_rps": round(self.goodput_rps, 3),
                "on_time_fraction": round(self.on_time_fraction, 6), "p50_ms": round(self.p50_ms, 3),
                "p99_ms": round(self.p99_ms, 3), "p99_completed_ms": round(self.p99_completed_ms, 3),
                "p99_success_ms": round(self.p99_success_ms, 3) if math.isfinite(self.p99_success_ms) else None,
                "max_ms": round(self.max_ms, 3), "simulated": True}


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of an ascending sequence (0 when empty)."""
    if not sorted_values:
        return 0.0
    return sorted_values[max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))]


def _success_quantile(completed_sorted: Sequence[int], offered: int, q: float) -> float:
    """Quantile (ms) of time to a successful answer, every request not completed counting as +inf."""
    if not offered:
        return 0.0
    rank = max(1, math.ceil(q * offered))
    return completed_sorted[rank - 1] / MS if rank <= len(completed_sorted) else math.inf


@dataclass
class SimResult:
    """Everything one simulated run did. All of it is SIMULATED."""
    arrivals: list[Arrival]
    channel_of: list[str]
    outcome: bytearray
    latency_ns: list[int]        # answer time - arrival, per request
    slo_ns: list[int]
    batches: list[BatchRecord]
    devices: int
    end_ns: int
    snapshot: dict[str, dict[str, Any]]
    polls: int = 0

    # -- per-request views ---------------------------------------------------
    def label(self, i: int) -> str:
        a = self.arrivals[i]
        return a.label if a.label is not None else self.channel_of[i]

    def on_time(self, i: int) -> bool:
        return self.outcome[i] == COMPLETED and self.latency_ns[i] <= self.slo_ns[i]

    def counts(self) -> dict[str, int]:
        out = {name: 0 for name in OUTCOME_NAMES.values()}
        for o in self.outcome:
            out[OUTCOME_NAMES[o]] += 1
        return out

    def span(self) -> tuple[int, int]:
        if not self.arrivals:
            return 0, 0
        return self.arrivals[0].at_ns, self.arrivals[-1].at_ns

    # -- aggregates ------------------------------------------------------------
    def stats(self, by: str = "label", start_ns: int | None = None, end_ns: int | None = None
              ) -> dict[str, GroupStats]:
        """Per class (`by="label"`) or per channel (`by="channel"`) for requests arriving in [start, end).

        p99 is taken, like the daemon's latency histogram, over every answered
        request but the `overloaded` ones (answered at once); p99_completed only
        over completed ones. Goodput is on-time completions per second of the span.
        """
        first, last = self.span()
        lo = first if start_ns is None else start_ns
        hi = last + 1 if end_ns is None else end_ns
        span_s = max(hi - lo, 1) / 1e9
        groups: dict[str, GroupStats] = {}
        lats: dict[str, list[int]] = {}
        done: dict[str, list[int]] = {}
        times = [a.at_ns for a in self.arrivals]
        for i in range(bisect.bisect_left(times, lo), bisect.bisect_left(times, hi)):
            key = self.label(i) if by == "label" else self.channel_of[i]
            g = groups.get(key)
            if g is None:
                g = groups[key] = GroupStats(span_s=span_s)
                lats[key], done[key] = [], []
            g.offered += 1
            o = self.outcome[i]
            if o == COMPLETED:
                g.completed += 1
                if self.latency_ns[i] <= self.slo_ns[i]:
                    g.on_time += 1
                else:
                    g.late += 1
                done[key].append(self.latency_ns[i])
            elif o == EXPIRED:
                g.expired += 1
            elif o == OVERLOADED:
                g.overloaded += 1
            else:
                g.failed += 1
            if o != OVERLOADED:
                lats[key].append(self.latency_ns[i])
        for key, g in groups.items():
            ls = sorted(lats[key])
            ds = sorted(done[key])
            g.p50_ms = quantile(ls, 0.50) / MS
            g.p99_ms = quantile(ls, 0.99) / MS
            g.max_ms = (ls[-1] / MS) if ls else 0.0
            g.p99_completed_ms = quantile(ds, 0.99) / MS
            g.p99_success_ms = _success_quantile(ds, g.offered, 0.99)
        return groups

    def total(self, start_ns: int | None = None, end_ns: int | None = None) -> GroupStats:
        """All classes together."""
        per = self.stats("label", start_ns, end_ns)
        first, last = self.span()
        lo = first if start_ns is None else start_ns
        hi = last + 1 if end_ns is None else end_ns
        g = GroupStats(span_s=max(hi - lo, 1) / 1e9)
        for s in per.values():
            for f in ("offered", "completed", "on_time", "late", "expired", "overloaded", "failed"):
                setattr(g, f, getattr(g, f) + getattr(s, f))
        times = [a.at_ns for a in self.arrivals]
        idx = range(bisect.bisect_left(times, lo), bisect.bisect_left(times, hi))
        ls = sorted(self.latency_ns[i] for i in idx if self.outcome[i] != OVERLOADED)
        ds = sorted(self.latency_ns[i] for i in idx if self.outcome[i] == COMPLETED)
        g.p50_ms, g.p99_ms = quantile(ls, 0.5) / MS, quantile(ls, 0.99) / MS
        g.max_ms = ls[-1] / MS if ls else 0.0
        g.p99_completed_ms = quantile(ds, 0.99) / MS
        g.p99_success_ms = _success_quantile(ds, g.offered, 0.99)
        return g

    def utilisation(self, start_ns: int | None = None, end_ns: int | None = None) -> float:
        """Mean fraction of [start, end) the devices spent computing (default: first arrival to the end)."""
        lo = self.span()[0] if start_ns is None else start_ns
        hi = self.end_ns if end_ns is None else end_ns
        if hi <= lo or not self.devices:
            return 0.0
        busy = sum(max(0, min(b.end_ns, hi) - max(b.start_ns, lo)) for b in self.batches)
        return busy / ((hi - lo) * self.devices)

    def mean_batch(self, channel: str | None = None) -> float:
        sel = [b.size for b in self.batches if channel is None or b.channel == channel]
        return sum(sel) / len(sel) if sel else 0.0


Router = Callable[[Arrival], str]


def rules_router(channels: Mapping[str, Any], routing: Any = None, plugins: Any = None) -> Router:
    """Route as the daemon does: the routing hook (``plugins.route``) over a ``[routing]`` table.

    Without plugins the built-in rule plugin's `matches` is applied directly.
    An arrival that names its channel skips routing.
    """
    from dynbatchd.config import RoutingSettings

    routing = routing or RoutingSettings(default=next(iter(channels)))
    config = SimpleNamespace(routing=routing, channels=channels)
    if plugins is None:
        from dynbatchd_plugins.routing import matches

        def by_rules(info: RequestInfo) -> str:
            for rule in routing.rules:
                if matches(rule, info):
                    return rule.channel
            return routing.default
        decide = by_rules
    else:
        def decide(info: RequestInfo) -> str:
            return plugins.route(info, config)

    def route(a: Arrival) -> str:
        if a.channel is not None:
            return a.channel
        name = decide(RequestInfo(a.model, a.tags, a.request_type, a.user_frequency, a.tokens, a.priority,
                                  a.tenant, None))
        return name if name in channels else routing.default
    return route


class _Device:
    __slots__ = ("index", "held", "free_at")

    def __init__(self, index: int):
        self.index = index
        self.held = 0        # batches dispatched and not yet finished (computing + waiting)
        self.free_at = 0     # when the last batch it holds will finish


def _execute(model: DeviceModel, items: list[Item]) -> tuple[int, set[int], bool]:
    """Device time, failed positions and whether an OOM happened, as the worker's bisection does it."""
    tokens = [it.tokens for it in items]
    total = sum(tokens)
    if model.fits(len(items), total):
        return model.latency_ns(len(items), total), set(), False
    errors: set[int] = set()
    spent = [round(model.oom_ms * MS)]

    def run(idx: list[int]) -> None:
        if not idx:
            return
        size, tok = len(idx), sum(tokens[i] for i in idx)
        if model.fits(size, tok):
            spent[0] += model.latency_ns(size, tok)
            return
        spent[0] += round(model.oom_ms * MS)
        if size == 1:
            errors.add(idx[0])
            return
        half = size // 2
        run(idx[:half])
        run(idx[half:])

    # As worker.execute: the whole batch failed once; go straight to its halves.
    everything = list(range(len(items)))
    if len(items) == 1:
        errors.add(0)
    else:
        run(everything[:len(items) // 2])
        run(everything[len(items) // 2:])
    return spent[0], errors, True


def simulate(channels: Mapping[str, Any], arrivals: Iterable[Any], *,
             device: DeviceModel | None = None, devices: int = 1, inflight: int = 2,
             window_policies: Mapping[str, Any] | None = None, sizers: Mapping[str, Any] | None = None,
             route: Router | None = None, routing: Any = None, plugins: Any = None,
             observe_every_ms: float = 1000.0, dispatch: str = "daemon", queue_lead_ms: float = 1.0,
             max_events: int = 50_000_000) -> SimResult:
    """Run `arrivals` through the real scheduler on `devices` simulated devices.

    `channels`: name -> ChannelSettings (each may name its window and batch-size
    policy). `window_policies` / `sizers`: the factories by name, e.g.
    ``Plugins.load().window_policies()``; the built-in fixed/static are always
    there. Routing: `route` (a function of an Arrival), else `routing`
    (RoutingSettings) through `plugins` (or the built-in rules); an arrival
    that names a channel goes there.

    Every `observe_every_ms` of simulated time (0: never), as the daemon's
    ``_observe_devices`` does once a second, every channel's batch sizer is
    told the devices' mean busy fraction since the last observation (compute
    time counted when a batch finishes, like a worker's ``busy_ns``), the
    fullest batch's share of the device memory limit in that period (what
    NVML would report; 0 without a limit) and the channel's queue length.

    `dispatch`: "daemon" (the default) decides slots and devices exactly as
    the daemon does (``dynbatchd.scheduler.slots``: a queued slot opens
    `queue_lead_ms` before the running batch ends; the device that can start
    the batch soonest takes it), except that the simulator knows when a device
    frees where the daemon estimates it from the learned cost model. "fewest"
    (a what-if: the daemon's first design) opens every slot at once and sends a
    batch to the device holding the fewest batches.
    """
    device = device or DeviceModel()
    if dispatch not in ("daemon", "fewest"):
        raise ValueError(f"dispatch must be 'daemon' or 'fewest', not {dispatch!r}")
    legacy = dispatch == "fewest"
    lead_ns = int(queue_lead_ms * MS)
    if devices < 1 or inflight < 1:
        raise ValueError("need at least one device with at least one slot")
    trace = sorted((as_arrival(a) for a in arrivals), key=lambda a: a.at_ns)
    if route is None:
        route = rules_router(channels, routing, plugins)
    sched = Scheduler(build_channels(dict(channels), window_policies, sizers))
    n = len(trace)
    outcome = bytearray(n)
    latency = [0] * n
    slo = [0] * n
    channel_of = [""] * n
    devs = [_Device(i) for i in range(devices)]
    free = devices * inflight
    done: list[tuple] = []          # heap: (end_ns, seq, device, batch, compute_ns, errors, oom, start_ns)
    records: list[BatchRecord] = []
    every_ns = int(observe_every_ms * MS)
    observe_at = (trace[0].at_ns + every_ns) if (trace and every_ns > 0) else NEVER
    busy_ns = [0] * devices          # per device, added when a batch finishes (like DeviceStats.busy_ns)
    busy_seen = [0] * devices
    observed_ns = trace[0].at_ns if trace else 0
    peak_memory = 0.0
    seq = 0
    polls = 0
    timer = NEVER
    i = 0
    now = trace[0].at_ns if trace else 0
    first = now
    now_last = now

    def answer(idx: int, code: int, at: int) -> None:
        if outcome[idx] != PENDING:
            raise SimulationError(f"request {idx} answered twice ({OUTCOME_NAMES[outcome[idx]]}, then "
                                  f"{OUTCOME_NAMES[code]})")
        outcome[idx] = code
        latency[idx] = at - trace[idx].at_ns

    def slots(at: int) -> tuple[int, int]:
        if legacy:
            return free, 0
        return open_slots([DeviceView(d.held, d.free_at) for d in devs], at, inflight, lead_ns)

    def pump(at: int) -> int:
        nonlocal seq, polls, free
        while True:   # as the daemon: dispatch, then ask again, while slots keep opening
            polls += 1
            open_now, busy = slots(at)
            decision = sched.poll(at, open_now, busy)
            for item in decision.expired:
                answer(item.payload, EXPIRED, at)
            for batch in decision.batches:
                if legacy:
                    dev = min(devs, key=lambda d: d.held)
                else:
                    dev = devs[pick_device([DeviceView(d.held, d.free_at) for d in devs], at, inflight, lead_ns)]
                dev.held += 1
                free -= 1
                compute, errors, oom = _execute(device, batch.items)
                start = max(at, dev.free_at)
                dev.free_at = start + compute
                seq += 1
                heapq.heappush(done, (dev.free_at, seq, dev, batch, compute, errors, oom, start))
            if not decision.batches or legacy:
                break
        open_now, busy = slots(at)
        wake = sched.next_wakeup(at, open_now, busy)
        if not legacy and sched.depth():
            opening = next_opening_ns([DeviceView(d.held, d.free_at) for d in devs], at, inflight, lead_ns)
            if opening is not None:
                wake = opening if wake is None else min(wake, opening)
        return NEVER if wake is None else max(wake, at + 1)

    def observe(at: int) -> None:
        nonlocal observed_ns, peak_memory
        span = at - observed_ns
        util = sum(min(1.0, (busy_ns[d] - busy_seen[d]) / span) for d in range(devices)) / devices if span > 0 else 0.0
        for channel in sched.channels.values():
            channel.sizer.observe(utilisation=util, memory=peak_memory, queue_len=channel.depth, now_ns=at)
        busy_seen[:] = busy_ns
        observed_ns = at
        peak_memory = 0.0

    events = 0
    while True:
        events += 1
        if events > max_events:
            raise SimulationError(f"simulation did not settle after {max_events} events")
        t_arr = trace[i].at_ns if i < n else NEVER
        t_done = done[0][0] if done else NEVER
        busy = i < n or done or sched.depth()
        t_obs = observe_at if busy else NEVER
        now = min(t_arr, t_done, timer, t_obs)
        if now >= NEVER:
            if sched.depth():
                # Nothing will ever wake a waiting lane (e.g. run_late with no window): drain, as on stop.
                sched.drain()
                now = max(now_last, 0)
                timer = pump(now)
                if not done and timer >= NEVER and sched.depth():
                    raise SimulationError(f"{sched.depth()} requests stuck with no device and no timer")
                continue
            break
        now_last = now
        while done and done[0][0] == now:
            _, _, dev, batch, compute, errors, oom, start = heapq.heappop(done)
            dev.held -= 1
            free += 1
            sched.completed(batch, compute, now)
            if oom:
                sched.out_of_memory(batch)
            channel = sched.channels[batch.channel]
            stats = channel.stats
            for pos, item in enumerate(batch.items):
                if pos in errors:
                    answer(item.payload, FAILED, now)
                    stats.failed += 1
                else:
                    answer(item.payload, COMPLETED, now)
                    stats.completed += 1
                    if now > item.deadline_ns:
                        stats.late += 1
                stats.latency.record((now - item.arrival_ns) / 1000)
            records.append(BatchRecord(batch.id, batch.channel, dev.index, len(batch.items), batch.tokens,
                                       batch.formed_ns, start, now, compute, batch.max_batch, oom,
                                       tuple(sorted({str(it.tenant) for it in batch.items}))))
            busy_ns[dev.index] += compute
            peak_memory = max(peak_memory, device.memory_fraction(len(batch.items), batch.tokens))
        while i < n and trace[i].at_ns == now:
            a = trace[i]
            name = route(a)
            if name not in sched.channels:
                raise KeyError(f"arrival {i} routed to unknown channel {name!r}")
            settings = sched.channels[name].settings
            deadline_ms = a.deadline_ms or settings.deadline_ms
            channel_of[i] = name
            slo[i] = int((a.slo_ms if a.slo_ms is not None else deadline_ms) * MS)
            item = Item(i + 1, a.model, now, now + int(deadline_ms * 1e6), a.tokens, a.tenant, i, name)
            if not sched.submit(item, now):
                answer(i, OVERLOADED, now)
            i += 1
        if now == t_obs:
            observe(now)
            observe_at = now + every_ns
        timer = pump(now)

    missing = [k for k in range(n) if outcome[k] == PENDING]
    if missing:
        raise SimulationError(f"{len(missing)} requests never answered (first: {missing[0]})")
    end = max((r.end_ns for r in records), default=now if n else 0)
    return SimResult(trace, channel_of, outcome, latency, slo, records, devices, max(end, first),
                     sched.snapshot(now), polls)
