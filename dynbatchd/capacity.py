"""How many devices a daily volume needs, with the daemon's batching and without it (every figure SIMULATED).

A device profile (`dynbatchd/profiles/*.toml`, or an operator's own file) gives
a cost curve in the simulated device's terms (`DeviceModel`), memory, power
draw and price. For a traffic shape, the peak hour's arrivals run through the
daemon's own engine (`dynbatchd.simulate.simulate`) on N simulated devices;
the smallest N whose run holds every channel's on-time target is found by
doubling, then bisection (assuming more devices never hold less). A mixed pool
is several profiles (``h100-80gb,l4-24gb``): one device of each makes a unit,
N units are searched for, each device simulated with its own cost curve and
its batches cut to its own memory (`simulate(size_for_device=True)`). The same
search with every channel's max_batch at 1 is the pool without batching.
Cost and energy follow from the pool by plain arithmetic, which the report
prints. The claims of the guide are checked against what this traffic gives.
"""

from __future__ import annotations

import math
import random
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Mapping, Sequence

import msgspec
from msgspec import Meta

from dynbatchd import config as cfgmod
from dynbatchd.errors import DynbatchdError
from dynbatchd.simulate import Arrival, DeviceModel, SimResult, mix_tokens, poisson, read_trace_csv, simulate

SECOND = 1_000_000_000
HOURS_PER_MONTH = 730.0          # 365 × 24 / 12
SECONDS_PER_DAY = 86_400
PROFILES_DIR = Path(__file__).parent / "profiles"
# What the guide claims (../shared/spec/SPEC.md); the report checks each against this traffic.
CLAIMS = {"fewer_devices": (0.35, 0.50), "less_energy": 0.40, "priority_on_time": 0.9995}

NonNegative = Annotated[float, Meta(ge=0)]


class Cost(cfgmod.Frozen, kw_only=True):
    """The cost curve, in `DeviceModel`'s terms: a batch takes base + per_item·n + per_token·tokens."""
    base_ms: NonNegative
    per_item_ms: NonNegative
    per_token_ms: NonNegative = 0.0
    memory_items: Annotated[int, Meta(ge=0)] = 0
    memory_tokens: Annotated[int, Meta(ge=0)] = 0
    oom_ms: NonNegative = 0.0


class Profile(cfgmod.Frozen, kw_only=True):
    """One device as capacity planning sees it; `source` says where its figures come from."""
    name: str
    source: Annotated[str, Meta(min_length=1)]
    description: str = ""
    estimate: bool = True
    memory_gb: Annotated[float, Meta(gt=0)]
    power_idle_w: NonNegative
    power_busy_w: NonNegative
    price_per_hour: NonNegative
    cost: Cost

    def device(self) -> DeviceModel:
        return DeviceModel(**msgspec.structs.asdict(self.cost))


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))


def load_profile(spec: str | Path) -> Profile:
    """A shipped profile by name (``h100-80gb``) or a TOML file; a bad one raises ConfigError naming the key."""
    path = Path(spec)
    if not path.exists():
        if str(spec).endswith(".toml") or "/" in str(spec):
            raise cfgmod.ConfigError(str(spec), "", "no such profile file")
        path = PROFILES_DIR / f"{spec}.toml"
        if not path.exists():
            raise cfgmod.ConfigError(str(spec), "", f"unknown profile (shipped: {', '.join(shipped_profiles())}; "
                                                    "or give a TOML file)")
    try:   # a directory, an unreadable or a binary file: one line naming it, as a bad config is
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise cfgmod.ConfigError(str(path), "", f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise cfgmod.ConfigError(str(path), "", f"not UTF-8 text ({exc.reason})") from None
    except tomllib.TOMLDecodeError as exc:
        raise cfgmod.ConfigError(str(path), "", f"not valid TOML: {exc}") from None
    profile = cfgmod.convert(data, Profile, str(path))
    if profile.power_busy_w < profile.power_idle_w:
        raise cfgmod.ConfigError(str(path), "power_busy_w", f"must be at least power_idle_w "
                                 f"({profile.power_idle_w:g}), got `{profile.power_busy_w:g}`")
    return profile


def load_pool(spec: str) -> list[Profile]:
    """``h100-80gb`` or ``h100-80gb,l4-24gb``: the profile of each device of one unit of the pool."""
    names = [part.strip() for part in str(spec).split(",")]
    if not all(names):
        raise cfgmod.ConfigError(str(spec), "", "a pool is profile names separated by commas, e.g. h100-80gb,l4-24gb")
    return [load_profile(name) for name in names]


# -- traffic --------------------------------------------------------------------
@dataclass(frozen=True)
class Traffic:
    """A day's volume and its shape; capacity is sized for the peak, `peak_factor` × the mean rate."""
    requests_per_day: float
    peak_factor: float = 2.0
    duration_s: float = 20.0        # simulated seconds of peak traffic per trial
    urgent_share: float = 0.1       # tagged urgent (the shipped routing sends them to realtime)
    tokens: int | None = None       # None: the guide's 7:2:1 mix
    trace: Path | None = None       # arrival pattern and sizes from a trace, rescaled to the peak rate
    seed: int = 1
    most: int | None = None         # a trace's rows read at most (one past: refused), as simulate reads one

    @property
    def peak_rps(self) -> float:
        return self.requests_per_day / SECONDS_PER_DAY * self.peak_factor

    def arrivals(self) -> list[Arrival]:
        rng = random.Random(self.seed)
        tag = lambda: ("urgent",) if rng.random() < self.urgent_share else ()   # noqa: E731
        if self.trace is not None:
            rows = read_trace_csv(self.trace, most=self.most)   # (a trial holds no more than the trace)
            if len(rows) < 2 or rows[-1][0] <= 0:
                raise ValueError(f"{self.trace}: needs at least two timestamped rows")
            speed = self.peak_rps / (len(rows) / rows[-1][0])   # the trace's mean rate becomes the peak rate
            return [Arrival(int(at / speed * SECOND), tokens, tags=tag())
                    for at, tokens in rows if at / speed < self.duration_s]
        out = []
        for t in poisson(rng, self.peak_rps, 0.0, self.duration_s):
            tokens = mix_tokens(rng)[1] if self.tokens is None else self.tokens
            out.append(Arrival(int(t * SECOND), tokens, tags=tag()))
        return out


# -- the search ------------------------------------------------------------------
@dataclass
class Trial:
    devices: int
    holds: bool
    on_time: dict[str, float]


@dataclass
class Sizing:
    """The smallest pool found for one profile, batched or not, and what it does at the peak."""
    devices: int
    trials: list[Trial]
    result: SimResult
    batching: bool

    def channels(self) -> dict[str, dict[str, float]]:
        return {name: {"on_time": g.on_time_fraction, "p99_ms": g.p99_ms, "offered": g.offered,
                       "mean_batch": self.result.mean_batch(name)}
                for name, g in self.result.stats("channel").items()}

    def busy_s_per_request(self, kinds: int = 1, kind: int | None = None) -> float:
        """Device seconds per request, of every device or (`kind` of `kinds`) of one kind of a mixed pool."""
        spent = sum(b.compute_ns for b in self.result.batches if kind is None or b.device % kinds == kind)
        return spent / SECOND / max(1, len(self.result.arrivals))


def targets_for(channels: Mapping[str, Any], target: float, priority_target: float) -> dict[str, float]:
    """The on-time target of each channel: `priority_target` for the highest priority, `target` for the rest."""
    top = max((c.priority for c in channels.values()), default=0)
    return {name: priority_target if c.priority == top and len(channels) > 1 else target
            for name, c in channels.items()}


def unbatched(channels: Mapping[str, Any]) -> dict[str, Any]:
    """The same channels dispatching one request at a time (max_batch 1, no window, no size policy)."""
    return {name: msgspec.structs.replace(c, max_batch=1, window_ms=0.0, window=None, batch_size=None)
            for name, c in channels.items()}


class Unattainable(DynbatchdError, ValueError):
    """A channel misses its target however many devices there are (its requests alone outlast its deadline)."""


def _reachable(result: SimResult, models: Sequence[DeviceModel]) -> dict[str, float]:
    """Per channel, the share of its requests that could finish in time alone on the fastest of
    `models`: what no pool, however large, can exceed."""
    offered: dict[str, int] = {}
    feasible: dict[str, int] = {}
    for i, arrival in enumerate(result.arrivals):
        name = result.channel_of[i]
        offered[name] = offered.get(name, 0) + 1
        alone = min(m.latency_ns(1, arrival.tokens) for m in models)
        feasible[name] = feasible.get(name, 0) + (alone <= result.slo_ns[i])
    return {name: feasible[name] / offered[name] for name in offered}


def _why_not(reachable: Mapping[str, float], targets: Mapping[str, float]) -> str | None:
    """Why no pool holds the targets (None: a larger one may)."""
    missed = [f"{name} can reach at most {v:.2%} on time (target {targets[name]:.2%})"
              for name, v in reachable.items() if v < targets.get(name, 0.0)]
    if not missed:
        return None
    return ("no pool size helps: " + "; ".join(missed)
            + ": some of its requests take longer than its deadline even alone on this device "
              "(a faster profile, a lower target, or routing long requests elsewhere)")


def smallest_pool(channels: Mapping[str, Any], arrivals: list[Arrival], model: DeviceModel | Sequence[DeviceModel],
                  targets: Mapping[str, float], *, limit: int = 4096, **sim: Any) -> tuple[int, list[Trial], SimResult]:
    """The fewest devices whose simulated run holds every channel's target (a channel with no
    traffic holds trivially), with every trial made. `model`: one device, or the devices of one
    unit of a mixed pool (the pool is then searched in whole units)."""
    unit = list(model) if isinstance(model, (list, tuple)) else [model]
    trials: list[Trial] = []
    results: dict[int, SimResult] = {}

    def holds(n: int) -> bool:
        pool = dict(device=unit[0], devices=n) if len(unit) == 1 else dict(device=unit * n)
        r = simulate(channels, arrivals, **pool, **sim)
        results[n] = r
        on_time = {name: g.on_time_fraction for name, g in r.stats("channel").items()}
        ok = all(v >= targets.get(name, 0.0) for name, v in on_time.items())
        trials.append(Trial(n * len(unit), ok, on_time))
        return ok

    lo, hi = 0, 1                      # lo: known to fail (0 devices always does), hi: to try
    while not holds(hi):
        why = _why_not(_reachable(results[hi], unit), targets)
        if why is not None:
            raise Unattainable(why)
        lo, hi = hi, hi * 2
        if hi > limit:
            raise ValueError(f"no pool of up to {limit} devices holds the targets")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid
    return hi * len(unit), trials, results[hi]


def size(channels: Mapping[str, Any], arrivals: list[Arrival], profile: Profile | Sequence[Profile],
         targets: Mapping[str, float], batching: bool, **sim: Any) -> Sizing:
    """The smallest pool of `profile` devices (several profiles: of units of one device each)."""
    chans = dict(channels) if batching else unbatched(channels)
    kinds = list(profile) if isinstance(profile, (list, tuple)) else [profile]
    models = [k.device() for k in kinds]
    n, trials, result = smallest_pool(chans, arrivals, models if len(models) > 1 else models[0], targets, **sim)
    return Sizing(n, trials, result, batching)


# -- the arithmetic ----------------------------------------------------------------
def monthly_cost(devices: int, price_per_hour: float) -> float:
    return devices * price_per_hour * HOURS_PER_MONTH


def energy_per_request_j(devices: int, profile: Profile, busy_s_per_request: float, requests_per_day: float) -> float:
    """Joules per request over a day on an always-on pool: every device draws idle power all day,
    plus (busy - idle) for the device time each request takes (as measured at the peak, where batches
    are fullest, so off-peak hours are if anything underestimated)."""
    return pool_energy_j(devices, [profile], [busy_s_per_request], requests_per_day)


def pool_energy_j(devices: int, kinds: Sequence[Profile], busy_s: Sequence[float], requests_per_day: float) -> float:
    """`energy_per_request_j` for a pool of `devices` made of equal numbers of each of `kinds`, each
    kind with its own device seconds per request (`busy_s`)."""
    units = devices / len(kinds)
    idle = units * sum(k.power_idle_w for k in kinds) * SECONDS_PER_DAY
    busy = sum((k.power_busy_w - k.power_idle_w) * b for k, b in zip(kinds, busy_s)) * requests_per_day
    return (idle + busy) / requests_per_day


def nvml_power() -> dict[str, Any] | None:
    """Name and power draw (W) of the first GPU ("cuda:0") from NVML, or None without pynvml, a GPU
    or a power reading (the device observer's probe, so CUDA_VISIBLE_DEVICES is honoured)."""
    from dynbatchd.telemetry import NvmlProbe

    probe = NvmlProbe()
    reading = probe.sample("cuda:0")
    if reading is None or reading.power_watts is None:
        return None
    return {"name": probe.name("cuda:0") or "cuda:0", "power_w": reading.power_watts}


@dataclass
class Plan:
    """One profile's pools (or a mixed pool's, `profile` a list) with and without batching, and the
    arithmetic on them."""
    profile: Profile | list[Profile]
    batched: Sizing
    unbatched: Sizing
    traffic: Traffic
    targets: dict[str, float] = field(default_factory=dict)

    @property
    def kinds(self) -> list[Profile]:
        return list(self.profile) if isinstance(self.profile, (list, tuple)) else [self.profile]

    def pool(self, s: Sizing) -> dict[str, Any]:
        kinds = self.kinds
        busy = [s.busy_s_per_request(len(kinds), k) for k in range(len(kinds))]
        units = s.devices // len(kinds)
        return {"devices": s.devices, "units": units,
                "monthly_cost": monthly_cost(units, sum(k.price_per_hour for k in kinds)),
                "energy_j_per_request": pool_energy_j(s.devices, kinds, busy, self.traffic.requests_per_day),
                "busy_ms_per_request": s.busy_s_per_request() * 1000, "utilisation": s.result.utilisation(),
                "channels": s.channels(), "trials": [t.__dict__ for t in s.trials]}

    def profile_dict(self) -> dict[str, Any]:
        """The profile; for a mixed pool, the unit's name, price and sources, each device's under "devices"."""
        kinds = self.kinds
        if len(kinds) == 1:
            return profile_dict(kinds[0])
        names = [k.name for k in kinds]
        return {"name": "+".join(names), "description": "a mixed pool, per unit one " + ", one ".join(names),
                "estimate": any(k.estimate for k in kinds), "source": "; ".join(f"{k.name}: {k.source}" for k in kinds),
                "price_per_hour": sum(k.price_per_hour for k in kinds), "devices": [profile_dict(k) for k in kinds]}

    def as_dict(self) -> dict[str, Any]:
        b, u = self.pool(self.batched), self.pool(self.unbatched)
        saved = 1 - b["devices"] / u["devices"]
        energy = 1 - b["energy_j_per_request"] / u["energy_j_per_request"]
        top = max(self.targets, key=lambda k: self.targets[k]) if self.targets else None
        prio = b["channels"].get(top, {}).get("on_time") if top else None
        lo, hi = CLAIMS["fewer_devices"]
        return {
            "simulated": True,
            "profile": self.profile_dict(),
            "batched": b, "unbatched": u, "targets": self.targets,
            "savings": {"devices": saved, "energy_per_request": energy, "monthly_cost": u["monthly_cost"] - b["monthly_cost"]},
            "claims": [
                {"claim": f"{lo:.0%}-{hi:.0%} fewer devices", "this_traffic": saved, "holds": saved >= lo},
                {"claim": f"{CLAIMS['less_energy']:.0%} less energy per request", "this_traffic": energy,
                 "holds": energy >= CLAIMS["less_energy"]},
                {"claim": f"{CLAIMS['priority_on_time']:.2%} of priority requests on time", "channel": top,
                 "this_traffic": prio, "holds": prio is not None and prio >= CLAIMS["priority_on_time"]},
            ],
        }


def profile_dict(p: Profile) -> dict[str, Any]:
    return {"name": p.name, "description": p.description, "estimate": p.estimate, "source": p.source,
            "memory_gb": p.memory_gb, "power_idle_w": p.power_idle_w, "power_busy_w": p.power_busy_w,
            "price_per_hour": p.price_per_hour, "cost": msgspec.structs.asdict(p.cost)}


def plan(channels: Mapping[str, Any], traffic: Traffic, profile: Profile | list[Profile],
         targets: Mapping[str, float], **sim: Any) -> Plan:
    arrivals = traffic.arrivals()
    if not arrivals:
        raise ValueError("the traffic has no arrivals in the simulated span: raise --requests-per-day or --duration")
    return Plan(profile, size(channels, arrivals, profile, targets, True, **sim),
                size(channels, arrivals, profile, targets, False, **sim), traffic, dict(targets))


def parse_count(text: str) -> float:
    """``10M``, ``2.5k``, ``1e6``, ``10000000`` -> a number of requests."""
    t = text.strip().replace("_", "").replace(",", "")
    scale = {"k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9}.get(t[-1:].lower(), 1.0)
    try:
        value = float(t[:-1] if scale != 1.0 else t)
    except ValueError:
        value = math.nan
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"{text!r}: must be a positive finite number, e.g. 10M, 2.5k or 1e6")
    return value * scale
