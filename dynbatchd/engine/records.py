"""The engine's records: the request as it travels (Job), what goes back (Answer), what goes to a
device (Dispatch) and comes back (Outcome), a canary's traffic share (Split), a feeder's death
(Loss) and one row of the device table (Device), with the limits that govern retries.

Plain data, kept apart from the logic that moves it so drivers, adapters and tests can name a
record without reading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable

from dynbatchd import protocol as P
from dynbatchd.scheduler import Batch, Item
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
        if len(self.up) == 1 and self.up[0]:   # (one feeder: the common case, once a batch)
            return 0
        load = [0] * len(self.up)
        for feeder in self.feeder_of.values():
            load[feeder] += 1
        return min((f for f, up in enumerate(self.up) if up), key=load.__getitem__)

