"""Open-loop load over ZeroMQ: send on a fixed schedule, whatever the replies do.

The one load generator of the benchmarks: `send_open_loop` sends any schedule of one-frame
requests (a Poisson draw here, a replayed trace in benchmarks/adaptive.py, a mixed overload
in benchmarks/reliability.py) and records each request's outcome; `run` is the Poisson run
with its summary.

Arrival times are drawn up front (exponential gaps at the offered rate) and every request
header is encoded before the clock starts. The loop then sends each request when its time
comes, never waiting for replies, and reads replies in between. Latency is measured from the
*scheduled* send time, so a generator that falls behind makes latency worse, never better
(no coordinated omission). Every loop is bounded in count and in time.

    python -m benchmarks.loadgen --endpoint ipc:///tmp/x/req.sock --model sim --rate 1000 --duration 5
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import zmq

from dynbatchd import protocol as P
from dynbatchd.client import build_request
from dynbatchd.simulate.traces import poisson

BURST = 256            # most requests sent before replies are read again
TICK_S = 0.0002        # shortest sleep: requests due within it go out together (bounds wake-ups/s)
KEEP_UP = 0.97         # a run "keeps up" when ok replies/s >= this share of requests sent/s (same window)
MISSING = "missing"    # pseudo error code: a request that got no reply by the end of the drain


@dataclass
class RunResult:
    rate: float                 # offered, requests/s
    duration_s: float
    sent: int
    ok: int
    errors: dict[str, int]      # error code -> count, including "missing"
    duplicates: int             # replies for an id already answered
    unexpected: int             # replies for ids never sent
    achieved_rps: float         # ok replies per second over the measured window
    sent_rps: float             # requests scheduled per second over the same window (the Poisson draw)
    p50_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    mean_ms: float
    measured: int               # ok replies in the percentiles (after warm-up)
    mean_batch: float           # batch size a request rode in, averaged over requests
    simulated: bool             # any reply said timing.simulated
    send_lag_p99_ms: float      # how late the generator sent, vs. the schedule
    gen_cpu_frac: float         # generator CPU / wall: near 1.0 means the generator is the limit
    elapsed_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def error_rate(self) -> float:
        return self.error_count / self.sent if self.sent else 0.0

    @property
    def exactly_once(self) -> bool:
        return self.errors.get(MISSING, 0) == 0 and self.duplicates == 0 and self.unexpected == 0

    @property
    def keeps_up(self) -> bool:
        """False when replies fall behind sends: a backlog was growing, so the rate is not sustainable."""
        return self.achieved_rps >= KEEP_UP * self.sent_rps

    def passes(self, slo_ms: float, max_error_rate: float = 0.001) -> bool:
        return self.measured > 0 and self.p99_ms <= slo_ms and self.error_rate < max_error_rate and self.keeps_up

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("raw", None)
        d.update(error_rate=self.error_rate, exactly_once=self.exactly_once, keeps_up=self.keeps_up)
        return d


def schedule(rate: float, duration_s: float, seed: int) -> np.ndarray:
    """Poisson arrival offsets in seconds, all below `duration_s`."""
    return np.fromiter(poisson(random.Random(seed), rate, 0.0, duration_s), dtype=np.float64)


def encode_all(n: int, model: str, inputs: list[Any], deadline_ms: float | None, tags: tuple[str, ...]) -> list[bytes]:
    """Request headers for ids 1..n, inputs taken round-robin. Text or plain values only (one frame)."""
    headers = []
    for i in range(n):
        frames = build_request(i + 1, model, inputs[i % len(inputs)], deadline_ms=deadline_ms, tags=tags)
        if len(frames) != 1:
            raise ValueError("the load generator sends single-frame requests (text or plain values)")
        headers.append(frames[0])
    return headers


@dataclass
class Sent:
    """What one open-loop run saw, per request i (header id i + 1), times in s from the clock's start."""
    offsets: np.ndarray          # scheduled send time
    done: np.ndarray             # when the (first) reply came; NaN: none by the end of the drain
    ok: np.ndarray               # the reply said ok
    codes: list[str | None]      # the error code of a reply that was not ok (None: ok, or no reply)
    batch: np.ndarray            # timing.batch_size of an ok reply
    parts: np.ndarray            # (n, 3) daemon timing of an ok reply: queue_us, compute_us, total_us
    sent_lag: np.ndarray         # how late each send went out, s
    sent: int                    # requests sent (all n, unless stopped early)
    duplicates: int              # replies for an id already answered
    unexpected: int              # replies that cannot be decoded or carry an id never sent
    simulated: bool              # any reply said timing.simulated
    cpu_s: float                 # the generator's own CPU time
    elapsed_s: float
    send_end_s: float            # when the last send was due (= the run's duration)

    def code(self, i: int) -> str:
        """"ok", the error code, or MISSING."""
        if self.ok[i]:
            return "ok"
        return self.codes[i] if self.codes[i] is not None else MISSING

    def latency_ms(self) -> np.ndarray:
        return (self.done - self.offsets) * 1000.0

    def errors(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.codes:
            if c is not None:
                out[c] = out.get(c, 0) + 1
        missing = int(np.isnan(self.done[:self.sent]).sum()) + (len(self.offsets) - self.sent)
        if missing:
            out[MISSING] = missing
        return out


def send_open_loop(endpoint: str, offsets: np.ndarray, headers: list[bytes], *, drain_s: float = 5.0,
                   duration_s: float | None = None, context: zmq.Context | None = None,
                   start_delay_s: float = 0.01) -> Sent:
    """The open loop: send headers[i] (a one-frame request whose id is i + 1) at offsets[i] s after
    the start, whatever the replies do, reading replies in between; then wait up to `drain_s`
    for the rest (counted from `duration_s`, the end of the schedule, by default the last send).
    `offsets` must be sorted. Bounded in count and in time."""
    n = len(offsets)
    if len(headers) != n:
        raise ValueError(f"{len(headers)} headers for {n} send times")
    offsets = np.asarray(offsets, dtype=float)
    if duration_s is None:
        duration_s = float(offsets[-1]) if n else 0.0
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    for opt, val in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0)):
        sock.setsockopt(opt, val)
    sock.connect(endpoint)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    done_at = np.full(n, np.nan)       # perf_counter when the reply came
    sent_lag = np.zeros(n)
    ok = np.zeros(n, dtype=bool)
    codes: list[str | None] = [None] * n
    batch = np.zeros(n, dtype=np.int32)
    parts = np.zeros((n, 3), dtype=np.int64)   # daemon's timing: queue_us, compute_us, total_us
    duplicates = unexpected = received = 0
    simulated = False
    send, recv, decode = sock.send, sock.recv_multipart, P.reply_decoder.decode
    clock = time.perf_counter
    time.sleep(0.05)  # let the connection settle before the clock starts
    cpu0 = time.process_time()
    t0 = clock() + start_delay_s
    due = offsets + t0
    hard_stop = t0 + duration_s + drain_s
    i = 0
    while True:
        now = clock()
        burst_end = min(n, i + BURST)
        while i < burst_end and due[i] <= now:
            send(headers[i], zmq.NOBLOCK)
            sent_lag[i] = now - due[i]
            i += 1
        while True:  # read every reply already here
            try:
                frames = recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            at = clock()
            try:
                reply = decode(frames[0])
                idx = reply.id - 1
            except Exception:
                unexpected += 1
                continue
            if not isinstance(idx, int) or not 0 <= idx < i:
                unexpected += 1
                continue
            if done_at[idx] == done_at[idx]:  # not NaN: answered before
                duplicates += 1
                continue
            done_at[idx] = at
            received += 1
            if reply.ok:
                ok[idx] = True
                if reply.timing is not None:
                    tm = reply.timing
                    batch[idx] = tm.batch_size
                    parts[idx] = (tm.queue_us, tm.compute_us, tm.total_us)
                    simulated = simulated or tm.simulated
            else:
                codes[idx] = reply.error.code if reply.error else "error"
        now = clock()
        if i >= n:
            if received >= n or now >= hard_stop:
                break
            poller.poll(max(1, int((hard_stop - now) * 1000)))
            continue
        if now >= hard_stop:  # cannot happen unless the clock jumps; bound the loop anyway
            break
        gap = due[i] - now
        if gap >= 0.001:
            poller.poll(int(gap * 1000))
        elif gap > 0:
            time.sleep(max(gap, TICK_S))
    elapsed = clock() - t0
    cpu = time.process_time() - cpu0
    sock.close(0)
    done = done_at - t0
    return Sent(offsets, done, ok, codes, batch, parts, sent_lag, i, duplicates, unexpected, simulated, cpu,
                elapsed, duration_s)


def run(endpoint: str, model: str, rate: float, duration_s: float, *, inputs: list[Any] | None = None,
        deadline_ms: float | None = None, tags: tuple[str, ...] = (), warmup_s: float = 0.5,
        drain_s: float = 5.0, seed: int = 1, context: zmq.Context | None = None, raw: bool = False) -> RunResult:
    """One open-loop Poisson run at `rate` requests/s for `duration_s`; then wait up to `drain_s` for stragglers."""
    offsets = schedule(rate, duration_s, seed)
    headers = encode_all(len(offsets), model, inputs or ["hello world"], deadline_ms, tags)
    s = send_open_loop(endpoint, offsets, headers, drain_s=drain_s, duration_s=duration_s, context=context)
    result = summarise(rate, duration_s, warmup_s, offsets, s.done, s.ok, s.batch, s.sent_lag, s.errors(),
                       s.duplicates, s.unexpected, s.simulated, s.cpu_s, s.elapsed_s)
    result.extra["breakdown_ms"] = breakdown(offsets, s.done, s.ok, s.parts, min(warmup_s, duration_s / 4))
    if raw:  # per request, for diagnosis (not serialised): scheduled and reply times (s), lag, daemon timings
        result.raw = {"offsets": offsets, "done": s.done, "ok": s.ok, "sent_lag": s.sent_lag, "parts_us": s.parts,
                      "batch": s.batch, "codes": s.codes}
    return result


def breakdown(offsets, done, ok, parts, warmup_s) -> dict[str, dict[str, float]]:
    """p50/p99 of where the time went: daemon queue, device compute, daemon total, and the rest
    (client -> daemon -> client transport, plus any generator lateness)."""
    sel = ok & (offsets >= warmup_s)
    if not sel.any():
        return {}
    client_ms = (done - offsets)[sel] * 1000.0
    queue, compute, total = (parts[sel, i] / 1000.0 for i in range(3))
    out = {}
    for name, v in (("daemon_queue", queue), ("compute", compute), ("daemon_total", total),
                    ("outside_daemon", client_ms - total)):
        out[name] = {"p50": round(float(np.percentile(v, 50)), 3), "p99": round(float(np.percentile(v, 99)), 3)}
    return out


def summarise(rate, duration_s, warmup_s, offsets, done, ok, batch, sent_lag, errors, duplicates, unexpected,
              simulated, cpu_s, elapsed) -> RunResult:
    n = len(offsets)
    start = min(warmup_s, duration_s / 4)
    span = duration_s - start
    steady = offsets >= start
    lat = (done - offsets)[ok & steady] * 1000.0
    q = (lambda p: round(float(np.percentile(lat, p)), 3)) if len(lat) else (lambda p: float("inf"))
    window = (done >= start) & (done <= duration_s) & ok   # NaN (no reply) compares False
    return RunResult(
        rate=rate, duration_s=duration_s, sent=n, ok=int(ok.sum()), errors=dict(sorted(errors.items())),
        duplicates=duplicates, unexpected=unexpected,
        achieved_rps=round(float(window.sum()) / span, 1) if span > 0 else 0.0,
        sent_rps=round(float(((offsets >= start) & (offsets <= duration_s)).sum()) / span, 1) if span > 0 else 0.0,
        p50_ms=q(50), p99_ms=q(99), p999_ms=q(99.9), max_ms=round(float(lat.max()), 3) if len(lat) else float("inf"),
        mean_ms=round(float(lat.mean()), 3) if len(lat) else float("inf"), measured=int(len(lat)),
        mean_batch=round(float(batch[ok].mean()), 2) if ok.any() else 0.0, simulated=simulated,
        send_lag_p99_ms=round(float(np.percentile(sent_lag, 99)) * 1000, 3) if n else 0.0,
        gen_cpu_frac=round(cpu_s / elapsed, 3) if elapsed > 0 else 0.0, elapsed_s=round(elapsed, 3))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.loadgen", description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint", required=True, help="the daemon's request socket, e.g. ipc:///tmp/x/req.sock")
    ap.add_argument("--model", required=True)
    ap.add_argument("--rate", type=float, required=True, help="offered requests per second (Poisson)")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds of sending")
    ap.add_argument("--text", action="append", help="request text (repeat for several; default 'hello world')")
    ap.add_argument("--deadline-ms", type=float, default=None)
    ap.add_argument("--warmup", type=float, default=0.5, help="seconds left out of the percentiles")
    ap.add_argument("--drain", type=float, default=5.0, help="seconds to wait for the last replies")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    result = run(args.endpoint, args.model, args.rate, args.duration, inputs=args.text, deadline_ms=args.deadline_ms,
                 warmup_s=args.warmup, drain_s=args.drain, seed=args.seed)
    print(json.dumps(result.to_dict(), indent=2))
    return 0 if result.exactly_once else 1


if __name__ == "__main__":
    raise SystemExit(main())
