"""The discrete-event driver: the daemon's engine on simulated devices and a virtual clock.

Everything that decides (routing, admission, batching, device choice, expiry,
retries, accounting) is `dynbatchd.engine.Engine`, exactly as the live daemon
runs it; this loop only plays the part of the sockets and the workers. Each
simulated device runs the batches it is sent one after another, each taking
what its `DeviceModel` says (bisected on out-of-memory by the worker's own
`execute`), and reports back through `Engine.completed`.
"""

from __future__ import annotations

import heapq
from functools import cache
from typing import Any, Callable, Iterable, Mapping, Sequence

from dynbatchd import protocol as P
from dynbatchd.engine import OK, Answer, Engine, Outcome
from dynbatchd.engine.intake import Intake, Refusal, RequestMeta, sim_config
from dynbatchd.hookspecs import RequestInfo
from dynbatchd.scheduler import build_channels
from dynbatchd.simulate.devices import DeviceModel, VirtualRunner
from dynbatchd.simulate.results import (COMPLETED, EXPIRED, FAILED, MS, OUTCOME_NAMES, OVERLOADED, PENDING,
                                        BatchRecord, SimResult)
from dynbatchd.simulate.traces import Arrival, as_arrival

NEVER = 1 << 62
_OUTCOMES = {OK: COMPLETED, P.DEADLINE_EXCEEDED: EXPIRED, P.OVERLOADED: OVERLOADED}

Router = Callable[[Arrival], str]


class SimulationError(AssertionError):
    """The simulated daemon broke an invariant (a request answered twice or never)."""


@cache
def _builtin_plugins() -> Any:
    from dynbatchd.plugins import Plugins

    return Plugins.load()


def rules_router(channels: Mapping[str, Any], routing: Mapping[str, Any] | None = None, plugins: Any = None) -> Router:
    """Route as the daemon does, through the routing hook (`Plugins.channel_for`) over a
    ``[routing]`` table as a file spells it (`sim_config`); `plugins` defaults to the installed
    ones. An arrival that names its channel skips routing."""
    config = sim_config(channels, routing)
    plugins = plugins or _builtin_plugins()

    def route(a: Arrival) -> str:
        if a.channel is not None:
            return a.channel
        return plugins.channel_for(RequestInfo(a.model, a.tags, a.request_type, a.user_frequency, a.tokens,
                                               a.priority, a.tenant, None), config)
    return route


class _Device:
    __slots__ = ("free_at", "busy_ns")

    def __init__(self) -> None:
        self.free_at = 0    # when the last batch it was sent really ends
        self.busy_ns = 0    # compute time of the batches it finished


def simulate(channels: Mapping[str, Any], arrivals: Iterable[Any], *,
             device: DeviceModel | Sequence[DeviceModel] | None = None, devices: int = 1, inflight: int = 2,
             window_policies: Mapping[str, Any] | None = None, sizers: Mapping[str, Any] | None = None,
             route: Router | None = None, routing: Any = None, plugins: Any = None,
             observe_every_ms: float = 1000.0, queue_lead_ms: float = 1.0,
             max_events: int = 50_000_000, cache: Any = None, cache_rule: Any = None,
             size_for_device: bool = False, config: Any = None, intake: Intake | None = None,
             codes: list[str] | None = None) -> SimResult:
    """Run `arrivals` through the daemon's engine on `devices` simulated devices.

    `device`: one DeviceModel for every device, or one per device (a mixed pool;
    `devices` is then their number). `channels`: name -> ChannelSettings (each may name its window and batch-size
    policy). `window_policies` / `sizers`: the factories by name, e.g.
    ``Plugins.load().window_policies()``; every built-in policy is always
    there (the scheduler's own tables). Routing: `route` (a function of an Arrival), else `routing`
    (the ``[routing]`` table as a file spells it, ``{"default": ..., "rules": [...]}``; a Config's:
    ``dynbatchd.config.table_of(config, "routing")``) through the routing hook of `plugins`; an
    arrival that names a channel goes there. Every `observe_every_ms` of simulated time (0:
    never), as the daemon's device observer does once a second, the engine is
    told the devices' busy fraction since the last look and the fullest
    batch's share of the memory limit (what NVML would report). `cache`: a
    `ResultCache` the engine answers from and fills, as the daemon's, keyed by
    (model, tenant, text) for arrivals with a `text`; `cache_rule`: the cache
    policy (a function of a `RequestInfo`, see the ``dynbatchd_cache_policies``
    hook), default: frequency admission for every request. `size_for_device`:
    the engine cuts each batch to the memory limits (memory_items,
    memory_tokens) of the device it goes to, as in a mixed pool whose devices'
    sizes are known (else a batch too big runs out of memory and is bisected).
    Every arrival goes through the daemon's intake (`dynbatchd.engine.intake`): routing, tenancy,
    the compliance hooks, the cache key and the deadline default decided as live; `config` (a
    daemon Config) gives it the models, ``[compliance]`` and routing, else any model goes; `intake`
    replaces it outright. `codes`: a list filled with each arrival's answer code.

        >>> from dynbatchd.config import ChannelSettings
        >>> r = simulate({"standard": ChannelSettings(max_batch=32, window_ms=10)},
        ...              [(0, 100, "standard")] * 64)
        >>> [b.end_ns for b in r.batches]
        [24000000, 48000000]
    """
    if isinstance(device, (list, tuple)):
        models, devices = list(device), len(device)
    else:
        models = [device or DeviceModel()] * devices
    if devices < 1 or inflight < 1:
        raise ValueError("need at least one device with at least one slot")
    trace = sorted((as_arrival(a) for a in arrivals), key=lambda a: a.at_ns)
    intake = intake or Intake.from_plugins(config or sim_config(channels, routing), plugins or _builtin_plugins(),
                                           cache_on=cache is not None, cache_rule=cache_rule)
    n = len(trace)
    first = trace[0].at_ns if trace else 0
    built = build_channels(dict(channels), window_policies, sizers)
    engine = Engine(built, [f"sim:{i}" for i in range(devices)], inflight=inflight,
                    queue_lead_ns=int(queue_lead_ms * MS), now_ns=first, cache=cache,
                    device_limits=[(m.memory_items, m.memory_tokens) for m in models] if size_for_device else None)
    for index in range(devices):
        engine.device_up(index)
    runners = [VirtualRunner(m) for m in models]
    devs = [_Device() for _ in range(devices)]
    outcome, latency, slo, channel_of = bytearray(n), [0] * n, [0] * n, [""] * n
    if codes is not None:
        codes[:] = [""] * n
    records: list[BatchRecord] = []
    running: list[tuple] = []      # heap: (end_ns, batch id, device, batch, outcome, start_ns)
    every_ns = int(observe_every_ms * MS)
    observe_at = first + every_ns if (trace and every_ns > 0) else NEVER
    seen_busy, observed_at, peak_memory = [0] * devices, first, 0.0

    def answer(answers: list[Answer], at: int) -> None:
        engine.take_events()   # no audit trail and no canary here: the engine's decisions need no carrying out
        for a in answers:
            i = a.payload
            if codes is not None:
                codes[i] = a.code
            if outcome[i] != PENDING:
                raise SimulationError(f"request {i} answered twice ({OUTCOME_NAMES[outcome[i]]}, then {a.code})")
            outcome[i] = _OUTCOMES.get(a.code, FAILED)
            latency[i] = at - trace[i].at_ns

    def step(at: int) -> int:
        dispatches, answers = engine.step(at)
        answer(answers, at)
        for d in dispatches:
            run, compute = runners[d.device].execute([item.tokens for item in d.batch.items])
            dev = devs[d.device]
            start = max(at, dev.free_at)
            dev.free_at = start + compute
            done = Outcome(compute, [True] * len(d.batch.items), run.errors, run.rejected, run.oom, True)  # (None: a cache miss)
            heapq.heappush(running, (dev.free_at, d.batch.id, d.device, d.batch, done, start))
        wake = engine.next_wakeup()
        return NEVER if wake is None else max(wake, at + 1)

    timer, i, now, last, events = NEVER, 0, first, first, 0
    while True:
        events += 1
        if events > max_events:
            raise SimulationError(f"simulation did not settle after {max_events} events")
        pending = i < n or running or engine.busy()
        now = min(trace[i].at_ns if i < n else NEVER, running[0][0] if running else NEVER, timer,
                  observe_at if pending else NEVER)
        if now >= NEVER:
            if not engine.busy():
                break
            # Nothing will ever wake a waiting lane (e.g. run_late with no window): drain, as on stop.
            engine.drain()
            now = last
            timer = step(now)
            if not running and timer >= NEVER and engine.busy():
                raise SimulationError(f"{engine.queued()} requests stuck with no device and no timer")
            continue
        last = now
        while running and running[0][0] == now:
            _, batch_id, index, batch, done, start = heapq.heappop(running)
            answer(engine.completed(index, batch_id, done, now), now)
            devs[index].busy_ns += done.compute_ns
            size = len(batch.items)
            peak_memory = max(peak_memory, models[index].memory_fraction(size, batch.tokens))
            records.append(BatchRecord(batch.id, batch.channel, index, size, batch.tokens, batch.formed_ns, start,
                                       now, done.compute_ns, batch.max_batch, done.oom,
                                       tuple(sorted({str(it.tenant) for it in batch.items}))))
        while i < n and trace[i].at_ns == now:
            a = trace[i]
            admitted = intake.admit(RequestMeta(a.model, a.tokens, a.tags, a.request_type, a.user_frequency,
                                                a.priority, a.tenant, text=a.text, deadline_ms=a.deadline_ms,
                                                channel=route(a) if route else a.channel), i)
            if isinstance(admitted, Refusal):
                channel_of[i], slo[i] = admitted.channel or "", 0
                if admitted.rule is not None:
                    engine.refused(admitted.channel)   # counted per channel, as the daemon does
                answer([Answer(i, admitted.code, admitted.message)], now)
                i += 1
                continue
            job, name = admitted, admitted.channel
            if not engine.has_channel(name):
                raise KeyError(f"arrival {i} routed to unknown channel {name!r}")
            channel_of[i] = name
            slo[i] = int((a.slo_ms if a.slo_ms is not None else job.deadline_ms) * MS)
            refusal = engine.submit(job, now)
            if refusal is not None:
                answer([refusal], now)
            i += 1
        if now == observe_at:
            span = now - observed_at
            util = sum(min(1.0, (d.busy_ns - seen) / span) for d, seen in zip(devs, seen_busy)) / devices
            engine.observe(now, util, peak_memory)
            seen_busy, observed_at, peak_memory = [d.busy_ns for d in devs], now, 0.0
            observe_at = now + every_ns
        timer = step(now)

    missing = [k for k in range(n) if outcome[k] == PENDING]
    if missing:
        raise SimulationError(f"{len(missing)} requests never answered (first: {missing[0]})")
    end = max((r.end_ns for r in records), default=now if n else 0)
    return SimResult(trace, channel_of, outcome, latency, slo, records, devices, max(end, first),
                     (snap := engine.snapshot(now))["channels"], snap["polls"])
