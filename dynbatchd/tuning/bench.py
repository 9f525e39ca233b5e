"""The guide's test matrix: every (load × mix × max_batch × window) cell measured, one way or another.

`simulated_cell` runs a cell on the daemon's engine with the simulated device
(`dynbatchd.simulate`: seconds, every figure SIMULATED). `LiveBench` runs it
against a running daemon through its real sockets: it retunes the channel on
the control socket (as `dynbatchctl tune` does), warms up, measures with the
`AsyncClient`, and `restore()` puts the original settings back (the CLI calls
it in a finally, so an error or Ctrl-C restores them too).

Closed loop (concurrency N: N requests always outstanding) cannot be a fixed
arrival list, so on the simulator it is found as a fixed point of Little's
law: the offered rate X with X x mean latency(X) = N, found by bisection.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from dynbatchd import config as cfgmod
from dynbatchd.simulate import Arrival, DeviceModel, config_device, poisson, read_trace_csv, run_config
from dynbatchd.simulate.results import COMPLETED, EXPIRED, quantile
from dynbatchd.simulate.traces import GUIDE_MIX
from dynbatchd.telemetry import fill_rate, on_time_fraction, scheduling_efficiency

SECOND = 1_000_000_000
MS = 1_000_000

FULL = dict(loads=(50, 100, 200, 500), max_batch=(4, 8, 16, 32), window_ms=(10.0, 50.0, 100.0, 200.0))
QUICK = dict(loads=(10, 25, 50, 100, 200), max_batch=(8, 32), window_ms=(10.0, 100.0))   # 5 loads: a knee
CLOSED_LOOP_ROUNDS = 7   # bisection steps: the rate within ~5% on the usual range


@dataclass(frozen=True, slots=True)
class Cell:
    """One configuration under one workload."""
    channel: str
    model: str
    max_batch: int
    window_ms: float
    load_kind: str          # "closed" (concurrency) or "open" (requests per second)
    load: float
    mix: str | None = "7:2:1"
    trace: str | None = None

    def label(self) -> str:
        unit = "clients" if self.load_kind == "closed" else "req/s"
        return f"max_batch={self.max_batch} window={self.window_ms:g}ms load={self.load:g} {unit}"


@dataclass(slots=True)
class Figures:
    """What one cell measured (latencies of the measured span only, after the warmup)."""
    requests: int = 0
    qps: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    p999_ms: float | None = None
    on_time: float | None = None
    device_utilisation: float | None = None
    device_memory: float | None = None
    fill_rate: float | None = None
    scheduling_efficiency: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d


def parse_mix(text: str) -> tuple[float, float, float]:
    """``7:2:1`` -> weights of short, medium and long requests (the guide's classes)."""
    parts = text.split(":")
    try:
        weights = tuple(float(p) for p in parts)
    except ValueError:
        raise ValueError(f"--mix {text!r}: three numbers short:medium:long, e.g. 7:2:1") from None
    if len(weights) != 3 or any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--mix {text!r}: three non-negative numbers short:medium:long, not all 0, e.g. 7:2:1")
    return weights  # type: ignore[return-value]


def token_sampler(mix: str | None, trace: str | None, seed: int, most: int | None = None) -> Callable[[], int]:
    """Request sizes: from a real trace's, in time order (cycled), else drawn from the mix. `most`:
    the trace's rows read at most (one past: refused, as simulate reads one)."""
    rng = random.Random(seed)
    if trace is not None:
        sizes = [tokens for _, tokens in read_trace_csv(trace, most=most)]
        if not sizes:
            raise ValueError(f"--trace {trace}: no requests in it")
        cycle = itertools.cycle(sizes)
        return lambda: next(cycle)
    weights = parse_mix(mix or "7:2:1")
    classes = [(lo, hi) for _, _, lo, hi in GUIDE_MIX]

    def draw() -> int:
        lo, hi = rng.choices(classes, weights=weights)[0]
        return rng.randint(lo, hi)
    return draw


def matrix(channel: str, model: str, *, max_batch: Sequence[int], window_ms: Sequence[float],
           concurrency: Sequence[int] = (), rates: Sequence[float] = (), mix: str | None = "7:2:1",
           trace: str | None = None) -> list[Cell]:
    """Every combination, loads innermost (so each config's QPS-vs-load curve is run together)."""
    loads = [("open", float(r)) for r in rates] if rates else [("closed", float(c)) for c in concurrency]
    if not loads or not max_batch or not window_ms:
        raise ValueError("the matrix is empty: give at least one load, one max_batch and one window")
    return [Cell(channel, model, b, float(w), kind, load, None if trace else mix, trace)
            for b in max_batch for w in window_ms for kind, load in loads]


def percentile(sorted_ms: Sequence[float], q: float) -> float | None:
    """The nearest-rank quantile (`dynbatchd.simulate.quantile`), None rather than 0 when there is none."""
    return float(quantile(sorted_ms, q)) if sorted_ms else None


# -- simulated --------------------------------------------------------------------------------------

def device_model_of(cfg: cfgmod.Config, model: str) -> DeviceModel:
    """The simulated device for `model`: its own options when it is a simulated model, else the
    config's first simulated model's, else the simulator's defaults."""
    return config_device(cfg, model)


def _arrivals(cell: Cell, rate: float, span_s: float, tokens: Callable[[], int], seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    return [Arrival(int(t * SECOND), tokens(), channel=cell.channel, model=cell.model)
            for t in poisson(rng, rate, 0.0, span_s)]


def _run_sim(cfg: cfgmod.Config, cell: Cell, rate: float, duration_s: float, warmup_s: float,
             device: DeviceModel, seed: int, plugins: Any) -> tuple[Figures, float]:
    """One open-loop simulation of `cell` at `rate`; its figures and the mean latency (ms) of what
    was answered in the measured span."""
    cell_cfg = cfgmod.with_channel(cfg, cell.channel, max_batch=cell.max_batch, window_ms=cell.window_ms)
    tokens = token_sampler(cell.mix, cell.trace, seed)
    arrivals = _arrivals(cell, rate, warmup_s + duration_s, tokens, seed)
    result = run_config(cell_cfg, plugins, arrivals, device)
    start, end = int(warmup_s * SECOND), int((warmup_s + duration_s) * SECOND)
    measured = [i for i, a in enumerate(result.arrivals) if start <= a.at_ns < end]
    done = sorted(result.latency_ns[i] / MS for i in measured if result.outcome[i] == COMPLETED)
    answered = [result.latency_ns[i] / MS for i in measured if result.outcome[i] in (COMPLETED, EXPIRED)]
    on_time = sum(1 for i in measured if result.on_time(i))
    batches = [b for b in result.batches if b.channel == cell.channel and start <= b.start_ns < end]
    wait_plus_compute = sum(result.latency_ns[i] for i in measured if result.outcome[i] == COMPLETED)
    compute = sum(b.compute_ns * b.size for b in batches)
    finished = sum(1 for i, a in enumerate(result.arrivals)   # answered inside the span: throughput
                   if result.outcome[i] == COMPLETED and start <= a.at_ns + result.latency_ns[i] < end)
    figures = Figures(
        requests=len(measured), qps=finished / duration_s, p50_ms=percentile(done, 0.50),
        p99_ms=percentile(done, 0.99), p999_ms=percentile(done, 0.999),
        on_time=on_time_fraction(on_time, len(measured)) if measured else None,
        device_utilisation=result.utilisation(start, end),
        device_memory=max((device.memory_fraction(b.size, b.tokens) for b in batches), default=0.0),
        fill_rate=fill_rate(sum(b.size / b.max_batch for b in batches), len(batches)) if batches else None,
        scheduling_efficiency=min(1.0, scheduling_efficiency(compute, wait_plus_compute - compute))
        if wait_plus_compute else None)
    mean = sum(answered) / len(answered) if answered else math.inf
    return figures, mean


def simulated_cell(cfg: cfgmod.Config, cell: Cell, *, duration_s: float, warmup_s: float, seed: int = 1,
                   plugins: Any = None) -> Figures:
    """Measure `cell` on the engine with the simulated device (SIMULATED)."""
    device = device_model_of(cfg, cell.model)
    if cell.load_kind == "open":
        return _run_sim(cfg, cell, cell.load, duration_s, warmup_s, device, seed, plugins)[0]
    # Closed loop, N always outstanding: the rate X where X x mean latency(X) = N (Little's law).
    # X x L(X) grows with X, so bisect on log X between what the deadline allows and a little
    # above what full batches can serve; each probe is one open-loop run.
    per_batch_ms = device.base_ms + device.per_item_ms * cell.max_batch
    capacity = cell.max_batch * 1000.0 / max(per_batch_ms, 1e-3) * max(1, cfg.devices.inflight)
    deadline_s = cfg.channels[cell.channel].deadline_ms / 1000.0
    lo, hi = max(0.5, cell.load / max(deadline_s, 1e-3) / 2), max(1.0, capacity * 1.2)
    runs: dict[float, tuple[Figures, float]] = {}

    def probe(rate: float) -> float:
        runs[rate] = _run_sim(cfg, cell, rate, duration_s, warmup_s, device, seed, plugins)
        return rate * runs[rate][1] / 1000.0 - cell.load     # > 0: more outstanding than N clients
    if lo >= hi or probe(hi) <= 0:
        rate = hi if hi in runs else lo
        if rate not in runs:
            probe(rate)
    else:
        for _ in range(CLOSED_LOOP_ROUNDS):
            mid = math.sqrt(lo * hi)
            if probe(mid) > 0:
                hi = mid
            else:
                lo = mid
        rate = lo if lo in runs else min(runs, key=lambda r: abs(r - lo))
    figures = runs[rate][0]
    figures.extra["offered_rps"] = round(rate, 3)   # the open-loop rate standing in for N clients
    return figures


# -- live -----------------------------------------------------------------------------------------

def request_text(tokens: int) -> str:
    """An input of about `tokens` tokens (words); the content is filler, never logged."""
    return " ".join(["bench"] * max(1, tokens))


def routing_hints(config: dict[str, Any], channel: str) -> dict[str, Any]:
    """What a bench request carries so the daemon's routing sends it to `channel`: nothing for the
    default channel, else the tag or request type of the first rule that names it."""
    routing = config.get("routing", {})
    if routing.get("default", "standard") == channel:
        return {}
    for rule in routing.get("rules", []):
        if rule.get("channel") != channel:
            continue
        if rule.get("tag"):
            return {"tags": [rule["tag"]]}
        if rule.get("request_type"):
            return {"request_type": rule["request_type"]}
    raise ValueError(f"no routing rule sends a tagged request to channel {channel!r}, and it is not the default "
                     "channel: bench cannot reach it")


class LiveBench:
    """Cells against a running daemon: retune through `control`, load through `endpoint`.

    `call(cmd, **args)` is the control-socket call (`dynbatchd.client.control_call` bound to the
    socket and its keys). The channel's settings when first seen are kept, and `restore()` puts
    them back; call it in a finally.
    """

    def __init__(self, call: Callable[..., Any], endpoint: str, channel: str, *, curve: Any = None,
                 timeout_s: float = 30.0):
        self.call, self.endpoint, self.channel, self.curve, self.timeout_s = call, endpoint, channel, curve, timeout_s
        config = call("config")
        found = config.get("channels", {}).get(channel)
        if found is None:
            raise ValueError(f"the daemon has no channel {channel!r}")
        self.original = {k: found.get(k) for k in ("max_batch", "window_ms")}
        self.deadline_ms = float(found.get("deadline_ms", 1000.0))
        self.hints = routing_hints(config, channel)
        self.restored = False

    def restore(self) -> dict[str, Any]:
        """Put the channel back as it was found (idempotent)."""
        result = self.call("tune", channel=self.channel, force=True, why="dynbatchctl bench: restore", **self.original)
        self.restored = True
        return result

    def _status(self) -> dict[str, Any]:
        return self.call("status")

    def run(self, cell: Cell, *, duration_s: float, warmup_s: float, seed: int = 1) -> Figures:
        # (each cell is the operator's own experiment: not refused by the risk assessment; restored after)
        self.call("tune", channel=self.channel, max_batch=cell.max_batch, window_ms=cell.window_ms, force=True,
                  why="dynbatchctl bench: a cell of the matrix")
        self.restored = False
        tokens = token_sampler(cell.mix, cell.trace, seed)
        latencies, codes, before_box = asyncio.run(self._load(cell, duration_s, warmup_s, tokens, seed))
        after = self._status()
        before = before_box["status"]
        done = sorted(latencies["ok"])
        measured = len(done) + sum(codes.values())
        on_time = sum(1 for ms in done if ms <= latencies["deadline_ms"])
        fill = None
        b0 = before.get("channels", {}).get(self.channel, {})
        b1 = after.get("channels", {}).get(self.channel, {})
        if "fill_sum" in b1 and b1.get("batches", 0) > b0.get("batches", 0):
            fill = fill_rate(b1["fill_sum"] - b0.get("fill_sum", 0.0), b1["batches"] - b0.get("batches", 0))
        devices = after.get("devices", [])
        util = _busy_between(before, after)
        compute = b1.get("compute_s", 0.0) - b0.get("compute_s", 0.0)
        wait = b1.get("wait_s", 0.0) - b0.get("wait_s", 0.0)
        efficiency = scheduling_efficiency(int(compute * 1e9), int(wait * 1e9)) if compute + wait > 0 else None
        mem = [d["gpu"]["memory_used_bytes"] / d["gpu"]["memory_total_bytes"] for d in devices
               if isinstance(d.get("gpu"), dict) and d["gpu"].get("memory_total_bytes")]
        return Figures(requests=measured, qps=len(done) / duration_s, p50_ms=percentile(done, 0.5),
                       p99_ms=percentile(done, 0.99), p999_ms=percentile(done, 0.999),
                       on_time=on_time_fraction(on_time, measured) if measured else None, device_utilisation=util,
                       device_memory=max(mem) if mem else None, fill_rate=fill,
                       scheduling_efficiency=efficiency, extra={"errors": dict(codes)})

    async def _load(self, cell: Cell, duration_s: float, warmup_s: float, tokens: Callable[[], int], seed: int):
        from dynbatchd.client import AsyncClient, DynbatchdError

        deadline_ms = self.deadline_ms
        ok: list[float] = []
        codes: dict[str, int] = {}
        loop = asyncio.get_running_loop()
        begin = loop.time()
        measure_from, stop_at = begin + warmup_s, begin + warmup_s + duration_s
        box: dict[str, Any] = {}
        kw = {"curve": self.curve} if self.curve is not None else {}
        async with AsyncClient(self.endpoint, timeout=self.timeout_s, **kw) as client:
            async def one() -> None:
                sent = loop.time()
                try:
                    n = tokens()
                    await client.infer(cell.model, request_text(n), tokens=n, **self.hints)
                    outcome = None
                except DynbatchdError as exc:
                    outcome = exc.code or "error"
                if sent >= measure_from and sent < stop_at:
                    if outcome is None:
                        ok.append((loop.time() - sent) * 1000.0)
                    else:
                        codes[outcome] = codes.get(outcome, 0) + 1

            async def mark() -> None:
                await asyncio.sleep(max(0.0, measure_from - loop.time()))
                box["status"] = await loop.run_in_executor(None, self._status)

            marker = asyncio.ensure_future(mark())
            if cell.load_kind == "closed":
                async def worker() -> None:
                    while loop.time() < stop_at:
                        await one()
                await asyncio.gather(*(worker() for _ in range(int(cell.load))))
            else:
                tasks = []
                for t in poisson(random.Random(seed), cell.load, begin, stop_at):
                    await asyncio.sleep(max(0.0, t - loop.time()))
                    tasks.append(asyncio.ensure_future(one()))
                await asyncio.gather(*tasks)
            await marker
        return {"ok": ok, "deadline_ms": deadline_ms}, codes, box


def _busy_between(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """Mean device busy fraction between two status snapshots: each device's busy_fraction is since
    it started (about the daemon's start), so busy time is fraction x uptime, differenced; clamped
    to 0..1 (a device restarted in between makes it approximate)."""
    t0 = before.get("daemon", {}).get("uptime_s")
    t1 = after.get("daemon", {}).get("uptime_s")
    d0, d1 = before.get("devices", []), after.get("devices", [])
    if not d1:
        return None
    if t0 is None or t1 is None or t1 <= t0 or len(d0) != len(d1):
        return sum(d.get("busy_fraction", 0.0) for d in d1) / len(d1)
    spans = [(b.get("busy_fraction", 0.0) * t1 - a.get("busy_fraction", 0.0) * t0) / (t1 - t0) for a, b in zip(d0, d1)]
    return sum(min(1.0, max(0.0, x)) for x in spans) / len(spans)


def best(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The best cell so far: most on-time throughput (QPS × on-time share), then lower p99."""
    scored = [r for r in rows if r.get("qps") is not None]
    if not scored:
        return None
    return max(scored, key=lambda r: (r["qps"] * (r.get("on_time") or 0.0), -(r.get("p99_ms") or math.inf)))
