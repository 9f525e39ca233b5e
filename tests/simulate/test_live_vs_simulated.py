"""Live and simulated agree: one seeded trace through the real daemon and through `simulate()`.

The same 3,000 arrivals (about 6 s, Poisson, seeded) are replayed twice:

- live: a real `dynbatchd start` with the `simulated` runner (a worker process that sleeps
  ``base_ms + per_item_ms·n + per_token_ms·tokens`` per batch), fed over real ZeroMQ sockets by
  one DEALER that sends each request at its scheduled time (open loop) and then waits for every
  reply with a bounded poll;
- simulated: `dynbatchd.simulate.simulate()` on a virtual clock.

Both sides take their channels, routing, device count, inflight, queue lead and DeviceModel
from the one TOML file the daemon was started with (`dynbatchd.config.load`), so the two cannot
be configured differently. Per channel the test compares completed / expired / overloaded,
mean batch size and on-time share, each within a stated tolerance, and prints the table
(`pytest -s`; docs/simulator.md records it). A live run whose sender could not keep to the
schedule (the machine was starved) is not a replay of the trace: it is run again (see
MAX_MEAN_SEND_LAG_MS).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import psutil
import pytest
import zmq

from dynbatchd import config as cfgmod, protocol as P
from dynbatchd.client import build_request
from dynbatchd.devices.pool import detect_devices
from dynbatchd.plugins import Plugins
from dynbatchd.simulate import COMPLETED, EXPIRED, Arrival, DeviceModel, SimResult, simulate

from conftest import start_daemon

SECOND = 1_000_000_000
SEED = 20240611
REQUESTS = 3000
SPAN_S = 6.0                 # 500 requests/s offered
URGENT_SHARE = 0.20          # tagged `urgent`: routed to realtime; the rest go to standard
HOPELESS_SHARE = 0.03        # deadline shorter than the device's fastest batch: must expire
HOPELESS_DEADLINE_MS = 0.5   # base_ms is 2: no batch, not even of one, can end in time
HOPELESS_AFTER_S = 0.5       # ...once the cost model has seen batches (before that it estimates 0)

# Device time: ~40% of the one simulated device at this load (SIMULATED utilisation is printed),
# so the daemon keeps up and the comparison is of batching, not of a collapsing queue.
BODY = """
    [models.sim]
    runner = "simulated"
    options = { base_ms = 2.0, per_item_ms = 0.1, per_token_ms = 0.0005 }

    [channels.realtime]
    max_batch = 8
    window_ms = 4
    deadline_ms = 100
    priority = 10

    [channels.standard]
    max_batch = 32
    window_ms = 15
    deadline_ms = 300
    queue_limit = 4096

    [routing]
    default = "standard"
    [[routing.rules]]
    tag = "urgent"
    channel = "realtime"
"""

# -- tolerances (live vs simulated), each chosen from measurements on this noisy 2-core machine ------
# (docs/simulator.md, "Live and simulated agree", has the runs behind each number.)
#
# Counts, of ~600 (realtime) and ~2,400 (standard) requests. The hopeless requests expire on
# both sides exactly (asserted one by one); every other request has 7-10x its live p99 latency as
# deadline (100 / 300 ms), so a live miss needs a stall of ~80 ms in the daemon or its worker.
# Measured: identical counts in all but one of the 40-odd runs the replay check below accepted
# (that one with two busy loops and other sessions' suites on the 2 cores: realtime 568 vs 583).
# Allowed: 0.5% of the channel's requests, at least 2 (3 realtime, 12 standard).
COUNT_TOLERANCE = 0.005
COUNT_TOLERANCE_MIN = 2
# Mean batch, as live / simulated. Live only ever adds time the model does not have: the daemon's
# timers fire late (asyncio rounds every epoll wait up to a whole millisecond, so a window due to
# close at 4.3 ms closes at 5 or later), and each batch pays the worker's Python around its sleep,
# msgpack and two ipc:// hops (status' learned base cost: 2.2-2.35 ms, 2 in the model). Later
# closes and longer batches both make batches larger, never smaller. Measured: 1.02-1.07 on a quiet machine
# (the simulator with every window 0.5 ms longer gives 1.03 standard / 1.05 realtime: the timer
# rounding is most of it), up to 1.15 with the rest of the suite and other work alongside
# (1.0-1.7 of the 2 cores busy with other processes; "other load" in the printed table).
# Since ea5c511 the standard channel (tokens outweigh items: it plans by size) holds an idle device
# no longer than its learned base cost: ~2 ms simulated, 2.2-2.35 ms live, and the timer's rounding
# up to a whole millisecond lands on that short hold, not on the 15 ms window: quiet, live / simulated
# reads 1.20-1.29 for standard (2.36-2.54 against 1.97), realtime unchanged.
# Allowed: 0.97-1.40 (the low side is the one that catches a wrong model). A simulated device 2x
# slower than the live one gives 0.87 (realtime), 3x 0.62-0.68 (both channels): both fail; 1.5x
# (~0.98) is within what this test can resolve.
MEAN_BATCH_LOW, MEAN_BATCH_HIGH = 0.97, 1.40
# On-time share (of every request offered: expired and overloaded count as misses): the count
# tolerance as a share, doubled for late completions; measured identical in the same runs.
ON_TIME_TOLERANCE = 0.01
# The replay check. The sender must keep to its schedule or live is replaying another trace:
# quiet, requests leave 0.1-0.2 ms late on average; when this process (and so, on 2 cores, the
# daemon beside it) is starved by other work they leave 0.6 ms to over 100 ms late, stalls of
# 10-600 ms send bursts together, mean batch grows 14-56% and requests expire. Such a run says nothing
# about the simulator: it is replayed on a fresh daemon, at most REPLAYS times in all (each
# replay takes ~8 s with the daemon's start; the simulated side runs once, it is deterministic).
# Measured: 1 run in 5 past the limit with the rest of the suite alongside, up to 2 in 3 with
# other sessions' benchmarks and busy loops on the machine too; REPLAYS disturbed runs in a row
# skip the comparison (that machine cannot tell a right simulator from a wrong one).
MAX_MEAN_SEND_LAG_MS = 0.5
# Other processes busy alongside disturb the daemon's timers without the sender lagging: 2026-12-07,
# standard's live mean batch read 2.41-2.46 (x1.22-1.25) in 20-odd runs with other load 0.00 cores,
# and 2.76 / 3.10 / 3.26 (x1.40-1.66) in the three with 0.20-0.33 cores (the suite's last daemons, other
# sessions' work). Such a run is replayed too.
MAX_OTHER_CORES = 0.1
REPLAYS = 3
REPLY_WAIT_S = 30.0          # bounded wait for the last replies (they come within ~0.2 s)


@dataclass(frozen=True)
class Planned:
    at_ns: int
    tokens: int
    urgent: bool
    hopeless: bool


def planned_arrivals() -> list[Planned]:
    """The trace, from SEED: Poisson times, 20% urgent, tokens 16..1024, 3% hopeless deadlines."""
    rng = random.Random(SEED)
    out, t = [], 0.0
    rate = REQUESTS / SPAN_S
    for _ in range(REQUESTS):
        t += rng.expovariate(rate)
        urgent = rng.random() < URGENT_SHARE
        tokens = rng.randint(16, 1024)
        hopeless = t > HOPELESS_AFTER_S and rng.random() < HOPELESS_SHARE
        out.append(Planned(int(t * SECOND), tokens, urgent, hopeless))
    return out


def channel_of(p: Planned) -> str:
    return "realtime" if p.urgent else "standard"


# -- live ---------------------------------------------------------------------------------------
@dataclass
class LiveRun:
    codes: list[str | None]     # per request: "ok" or the error code (None: never answered)
    lag_ms: list[float]         # how late each request left against its schedule
    duplicates: int
    status: dict
    other_cores: float          # CPU the rest of the machine used meanwhile, in cores (of 2)

    @property
    def mean_lag_ms(self) -> float:
        return sum(self.lag_ms) / len(self.lag_ms)


def drive_live(endpoint: str, plan: list[Planned]) -> tuple[list[str | None], list[float], int]:
    """Open loop on one DEALER: each request at its time, replies read in between, then a bounded wait."""
    frames = [build_request(i, "sim", f"request {i}", tags=("urgent",) if p.urgent else (), tokens=p.tokens,
                            deadline_ms=HOPELESS_DEADLINE_MS if p.hopeless else None)
              for i, p in enumerate(plan)]   # encoded before the clock starts
    codes: list[str | None] = [None] * len(plan)
    lag_ms = [0.0] * len(plan)
    duplicates = 0
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    for opt in (zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM):
        sock.setsockopt(opt, 0)   # no limit: nothing dropped on our side
    sock.connect(endpoint)
    answered = 0

    def read_ready() -> None:
        nonlocal answered, duplicates
        while True:
            try:
                reply = P.reply_decoder.decode(sock.recv_multipart(zmq.NOBLOCK)[0])
            except zmq.Again:
                return
            if codes[reply.id] is not None:
                duplicates += 1
                continue
            codes[reply.id] = "ok" if reply.ok else reply.error.code
            answered += 1

    try:
        start = time.monotonic() + 0.05
        for i, p in enumerate(plan):
            due = start + p.at_ns / SECOND
            while (left := due - time.monotonic()) > 0:
                if left > 0.001:
                    if sock.poll(int(left * 1000)):   # wakes early for a reply
                        read_ready()
                else:
                    time.sleep(left)
            lag_ms[i] = (time.monotonic() - due) * 1000
            sock.send_multipart(frames[i])
            if i % 16 == 0:
                read_ready()
        limit = time.monotonic() + REPLY_WAIT_S
        while answered < len(plan) and time.monotonic() < limit:
            if sock.poll(100):
                read_ready()
    finally:
        sock.close(0)
        ctx.term()
    return codes, lag_ms, duplicates


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (every core, every process)."""
    t = psutil.cpu_times()
    return sum(getattr(t, f) for f in t._fields if f not in ("idle", "iowait", "guest", "guest_nice"))


def own_cpu_s(procs: list[psutil.Process]) -> float:
    """CPU seconds of this test's own processes: this one, the daemon and its workers."""
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def run_live(tmp_path, plan: list[Planned]) -> tuple[cfgmod.Config, LiveRun]:
    daemon = start_daemon(tmp_path, BODY)
    try:
        cfg = cfgmod.load(daemon.config)
        root = psutil.Process(daemon.proc.pid)
        procs = [psutil.Process(), root, *root.children(recursive=True)]
        busy0, own0, t0 = machine_busy_s(), own_cpu_s(procs), time.monotonic()
        codes, lag_ms, duplicates = drive_live(daemon.endpoint, plan)
        wall = time.monotonic() - t0
        other = max(0.0, (machine_busy_s() - busy0) - (own_cpu_s(procs) - own0)) / wall
        status = daemon.status()
    finally:
        assert daemon.stop() == 0, daemon.logs()
    return cfg, LiveRun(codes, lag_ms, duplicates, status, other)


# -- simulated ----------------------------------------------------------------------------------
def device_model(cfg: cfgmod.Config) -> DeviceModel:
    return DeviceModel.from_options(cfg.models["sim"].options)


def run_simulated(cfg: cfgmod.Config, plan: list[Planned]) -> SimResult:
    plugins = Plugins.load()
    arrivals = [Arrival(p.at_ns, p.tokens, tags=("urgent",) if p.urgent else (),
                        deadline_ms=HOPELESS_DEADLINE_MS if p.hopeless else None) for p in plan]
    return simulate(cfg.channels, arrivals, device=device_model(cfg), devices=len(detect_devices(cfg.devices.use)),
                    inflight=cfg.devices.inflight, queue_lead_ms=cfg.devices.queue_lead_ms,
                    window_policies=plugins.window_policies(), sizers=plugins.batch_sizers(),
                    routing=cfgmod.table_of(cfg, "routing"), plugins=plugins)


# -- the comparison ------------------------------------------------------------------------------
def figures(live: LiveRun, sim: SimResult) -> dict[str, dict[str, tuple[float, float]]]:
    """channel -> figure -> (live, simulated)."""
    per = sim.stats(by="channel")
    out = {}
    for name in sorted(per):
        s, g = live.status["channels"][name], per[name]
        out[name] = {
            "offered": (s["offered"], g.offered),
            "completed": (s["completed"], g.completed),
            "expired": (s["expired"], g.expired),
            "overloaded": (s["rejected"]["overloaded"], g.overloaded),
            "mean_batch": (s["mean_batch"], sim.mean_batch(name)),
            "on_time": (s["on_time"], g.on_time_fraction),
        }
    return out


def tolerance(figure: str, offered: int) -> float:
    """The allowed |live - simulated| (mean batch has its ratio band instead: `within`)."""
    if figure == "on_time":
        return ON_TIME_TOLERANCE      # absolute, a share
    if figure == "offered":
        return 0
    return max(COUNT_TOLERANCE_MIN, round(COUNT_TOLERANCE * offered))


def within(figure: str, live: float, sim: float, tol: float) -> bool:
    if figure == "mean_batch":   # a ratio band: live may run larger, hardly smaller (see above)
        return MEAN_BATCH_LOW * sim <= live <= MEAN_BATCH_HIGH * sim
    return abs(live - sim) <= tol


def table(rows: dict[str, dict[str, tuple[float, float]]], sim: SimResult, live: LiveRun) -> str:
    lags = sorted(live.lag_ms)
    lines = [f"live vs SIMULATED: {REQUESTS} requests over {SPAN_S:g} s, seed {SEED}; "
             f"simulated device utilisation {100 * sim.utilisation():.1f}%; "
             f"sender lag mean {sum(lags) / len(lags):.3f} ms, p99 {lags[int(0.99 * len(lags))]:.3f} ms; "
             f"other load {live.other_cores:.2f} cores",
             f"{'channel':<10} {'figure':<11} {'live':>9} {'simulated':>10} {'tolerance':>10}  ok"]
    for name, figs in rows.items():
        offered = figs["offered"][1]
        for fig, (lv, sv) in figs.items():
            tol = tolerance(fig, offered)
            if fig == "mean_batch":
                cells = (f"{lv:.3f}", f"{sv:.3f}")
                tol_s = f"x{MEAN_BATCH_LOW:g}-{MEAN_BATCH_HIGH:g}"
            elif fig == "on_time":
                cells, tol_s = (f"{100 * lv:.2f}%", f"{100 * sv:.2f}%"), f"±{100 * tol:g} pt"
            else:
                cells, tol_s = (f"{lv:d}", f"{sv:d}"), f"±{tol:g}"
            mark = "yes" if within(fig, lv, sv, tol) else "NO"
            lines.append(f"{name:<10} {fig:<11} {cells[0]:>9} {cells[1]:>10} {tol_s:>10}  {mark}")
    return "\n".join(lines)


def test_live_daemon_and_simulator_agree_per_channel(tmp_path):
    plan = planned_arrivals()
    for attempt in range(1, REPLAYS + 1):
        cfg, live = run_live(tmp_path / str(attempt), plan)
        if live.mean_lag_ms <= MAX_MEAN_SEND_LAG_MS and live.other_cores <= MAX_OTHER_CORES:
            break
        print(f"\nreplay {attempt} left requests {live.mean_lag_ms:.3f} ms late on average "
              f"(at most {MAX_MEAN_SEND_LAG_MS:g} ms) with {live.other_cores:.2f} cores of other load "
              f"(at most {MAX_OTHER_CORES:g}): the machine was busy, this was not the trace")
    sim = run_simulated(cfg, plan)
    rows = figures(live, sim)
    print("\n" + table(rows, sim, live))

    # Every request answered exactly once, nothing dropped on the way.
    assert None not in live.codes, f"{live.codes.count(None)} requests got no reply within {REPLY_WAIT_S:g} s"
    assert live.duplicates == 0
    daemon = live.status["daemon"]
    assert daemon["dropped"] == 0 and daemon["replies_undelivered"] == 0 and daemon["bad_requests"] == 0
    # The sender kept to the schedule, else live replayed another trace than the simulator: on a
    # machine busy through every replay (a contended host; 2026-12-07, 0.4-0.7 cores of other load
    # for minutes) the comparison cannot be made, and is skipped saying so (every answer came once, above).
    if live.mean_lag_ms > MAX_MEAN_SEND_LAG_MS or live.other_cores > MAX_OTHER_CORES:
        pytest.skip(f"{REPLAYS} times the machine was too busy to replay the schedule "
                    f"(last mean lag {live.mean_lag_ms:.3f} ms, {live.other_cores:.2f} cores of other load)")
    # Routing, and every hopeless deadline answered deadline_exceeded on both sides.
    assert set(rows) == {"realtime", "standard"}
    for i, p in enumerate(plan):
        assert sim.channel_of[i] == channel_of(p)
        if p.hopeless:
            assert live.codes[i] == P.DEADLINE_EXCEEDED, (i, live.codes[i])
            assert sim.outcome[i] == EXPIRED, (i, sim.outcome[i])
        else:
            assert sim.outcome[i] == COMPLETED, (i, sim.outcome[i])
    for name in rows:
        hopeless = sum(p.hopeless for p in plan if channel_of(p) == name)
        assert hopeless >= 10, "the trace must exercise expiry in every channel"
        # What the clients got is what status counted.
        got = [c for c, p in zip(live.codes, plan) if channel_of(p) == name]
        s = live.status["channels"][name]
        assert (got.count("ok"), got.count(P.DEADLINE_EXCEEDED), got.count(P.OVERLOADED)) == \
               (s["completed"], s["expired"], s["rejected"]["overloaded"])
    # Live and simulated agree, per channel and figure.
    bad = [(name, fig, lv, sv) for name, figs in rows.items() for fig, (lv, sv) in figs.items()
           if not within(fig, lv, sv, tolerance(fig, figs["offered"][1]))]
    assert not bad, f"live and simulated differ beyond tolerance: {bad}\n{table(rows, sim, live)}"
