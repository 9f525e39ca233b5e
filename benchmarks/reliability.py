"""Reliability of a live daemon: worker kills under load, fuzzing by the million, repeated overload.

    python -m benchmarks.reliability              # full: 10 kills, 1,000,000 + 100,000 bad frames, 5 x 60 s at 3x
    python -m benchmarks.reliability --quick      # smoke test: 2 kills, 50,000 + 5,000 frames, 1 x 10 s
    python -m benchmarks.reliability --only fuzz --frames 200000

Every section starts its own `dynbatchd start` (the shared launcher, benchmarks/harness.py) with
ipc:// sockets in a temporary directory, two simulated accelerators (`use = ["cpu", "cpu"]`,
runner "simulated": 20 ms + 1 ms/item, a sleep in the worker, SIMULATED) and two channels
(realtime: tag urgent, batch 8, deadline 200 ms; standard: batch 16, deadline 500 ms). Load comes
from the benchmarks' one open-loop generator (`loadgen.send_open_loop`).

1. kills: open-loop load at 30% of capacity (requests carry a 30 s deadline, so that only loss
   can fail them) while a worker is SIGKILLed every few seconds (pids from status().devices[i].pid,
   the two devices in turn, each once both are ready). Goal: 0 requests without a reply, 0
   answered twice.
2. fuzz: malformed frames (junk, cut and bit-flipped headers, wrong types, nesting towers,
   tensor/frame mismatches, REQ-style envelopes, oversized messages, bad field values) from
   parallel DEALER processes at the request socket, then at the control socket, each sender
   keeping a window in flight; meanwhile a monitor pings and sends one valid request every
   0.5 s. Goals: every frame with a body answered (and only those), the daemon up and answering
   throughout, its VmRSS at the end < 5% above the start.
3. overload: 3x capacity for the set time (10% realtime), five rounds back to back on one daemon,
   each with idle probes before and probes after. Goals per round: realtime on time (answered ok
   within its 200 ms deadline, counted from the scheduled send) >= 99.9%; the daemon's VmRSS
   bounded (its peak in the last round within 5% of the first round's); standard probes normal
   again (ok, latency within 2x the idle p99 + 20 ms, every later probe too) within 1 s of the
   load stopping.

Figures go to stdout (with the command and the commit) and to benchmarks/results/reliability.json.
Exit status 0 when every goal is met. Bounded in time: every loop has a deadline.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

from benchmarks import loadgen
from benchmarks.harness import REPO, Daemon, ipc_daemon, machine_busy_s, vm_rss_bytes, wait_until
from dynbatchd import protocol as P
from dynbatchd.client import Client, DynbatchdError, build_request, control_call

RESULTS = REPO / "benchmarks" / "results"
SIM = "SIMULATED"

BASE_MS, PER_ITEM_MS = 20.0, 1.0
DEVICES = 2
RT_BATCH, STD_BATCH = 8, 16
RT_DEADLINE_MS, STD_DEADLINE_MS = 200.0, 500.0
CAPACITY_RPS = DEVICES * STD_BATCH / ((BASE_MS + PER_ITEM_MS * STD_BATCH) / 1000)   # 889 req/s with full batches
REALTIME_SHARE = 0.10
MODELS = {"sim"}


def config(endpoint: str, control: str) -> str:
    return textwrap.dedent(f"""\
        [daemon]
        listen = "{endpoint}"
        control = "{control}"
        log_level = "warning"
        drain_timeout_s = 10
        [devices]
        use = {json.dumps(["cpu"] * DEVICES)}
        inflight = 2
        cpu_threads = 1
        restart_limit = 1000
        [models.sim]
        runner = "simulated"
        options = {{ base_ms = {BASE_MS}, per_item_ms = {PER_ITEM_MS} }}
        [channels.realtime]
        max_batch = {RT_BATCH}
        window_ms = 2
        deadline_ms = {RT_DEADLINE_MS}
        queue_limit = 1024
        priority = 2
        [channels.standard]
        max_batch = {STD_BATCH}
        window_ms = 10
        deadline_ms = {STD_DEADLINE_MS}
        queue_limit = 4096
        priority = 1
        [routing]
        default = "standard"
        [[routing.rules]]
        tag = "urgent"
        channel = "realtime"
        """)


def start(tmp: Path, name: str) -> Daemon:
    return ipc_daemon(tmp, config, name=f"dynbatchd ({name})").start(120)


def mixed_headers(n: int, rng: np.random.Generator, deadline_ms: float | None = None,
                  realtime_share: float = REALTIME_SHARE) -> tuple[list[bytes], np.ndarray]:
    """n one-frame requests for ids 1..n, a `realtime_share` of them tagged urgent; and which."""
    urgent = rng.random(n) < realtime_share
    headers = [build_request(i + 1, "sim", "reliability probe text", deadline_ms=deadline_ms,
                             tags=("urgent",) if urgent[i] else ())[0] for i in range(n)]
    return headers, urgent


def pct(a: float, b: float) -> float:
    return 100.0 * a / b if b else 0.0


# ---------------------------------------------------------------------------
# 1. worker kills under load
# ---------------------------------------------------------------------------

def bench_kills(kills: int, log=print) -> dict[str, Any]:
    interval_s = 4.0
    rate = 0.3 * CAPACITY_RPS
    duration = kills * interval_s + 6.0
    log(f"\n== 1. {kills} worker SIGKILLs under open-loop load ({rate:.0f} req/s, 30 s deadlines, "
        f"{DEVICES} {SIM} devices) ==")
    with tempfile.TemporaryDirectory(prefix="dynbatchd-rel-") as tmp:
        daemon = start(Path(tmp), "kills")
        try:
            rng = np.random.default_rng(7)
            offsets = loadgen.schedule(rate, duration, seed=7)
            headers, _ = mixed_headers(len(offsets), rng, deadline_ms=30_000)
            done: list[dict[str, Any]] = []
            stop = threading.Event()

            def all_ready() -> list[dict[str, Any]] | None:
                devices = daemon.status()["devices"]
                return devices if all(d["state"] == "ready" and d["pid"] > 0 for d in devices) else None

            def killer() -> None:
                time.sleep(2.0)
                for k in range(kills):
                    if stop.is_set():
                        return
                    target = k % DEVICES
                    try:
                        pid = wait_until(all_ready, 60, message="devices not ready for the next kill")[target]["pid"]
                    except (AssertionError, DynbatchdError) as exc:
                        done.append({"error": str(exc)})
                        return
                    at = time.monotonic()
                    os.kill(pid, signal.SIGKILL)

                    def replaced() -> dict[str, Any] | None:
                        d = daemon.status()["devices"][target]
                        return d if d["state"] == "ready" and d["pid"] not in (pid, 0) else None
                    try:
                        back = wait_until(replaced, 60, message="killed worker not replaced")
                        done.append({"device": target, "pid": pid, "new_pid": back["pid"],
                                     "back_after_s": round(time.monotonic() - at, 2)})
                    except (AssertionError, DynbatchdError) as exc:
                        done.append({"device": target, "pid": pid, "error": str(exc)})
                    stop.wait(max(0.0, interval_s - (time.monotonic() - at)))

            thread = threading.Thread(target=killer, daemon=True)
            thread.start()
            sent = loadgen.send_open_loop(daemon.endpoint, offsets, headers, drain_s=40.0)
            stop.set()
            thread.join(70)
            status = daemon.status()
        finally:
            code = daemon.stop(60)
    errors = sent.errors()
    lost = errors.pop(loadgen.MISSING, 0)
    ok = int(sent.ok.sum())
    kills_done = [k for k in done if "error" not in k]
    out = {"kills_asked": kills, "kills_done": len(kills_done), "kills": done, "offered_rps": round(rate, 1),
           "duration_s": duration, "requests": sent.sent, "ok": ok, "lost": lost, "answered_twice": sent.duplicates,
           "unexpected": sent.unexpected, "errors": errors,
           "restarts": [d["restarts"] for d in status["devices"]], "daemon_exit": code,
           "trouble": [t for t in daemon.trouble if "exited with -9" not in t][:10]}   # the kills themselves
    out["met"] = lost == 0 and sent.duplicates == 0 and len(kills_done) == kills
    backs = [k["back_after_s"] for k in kills_done]
    log(f"kills done: {len(kills_done)} of {kills} (workers back in {min(backs, default=0):.2f}..{max(backs, default=0):.2f} s); "
        f"restarts per device: {out['restarts']}")
    log(f"requests: {sent.sent} sent, {ok} ok, lost {lost}, answered twice {sent.duplicates}, "
        f"unexpected {sent.unexpected}, errors {errors or 'none'}; goal 0 and 0: {'MET' if out['met'] else 'MISSED'}")
    return out


# ---------------------------------------------------------------------------
# 2. fuzzing
# ---------------------------------------------------------------------------

def has_body(frames: list[bytes]) -> bool:
    """What the daemon's ROUTER sees after the DEALER's identity: a lone empty frame is a REQ
    delimiter with no message (dropped, counted); everything else has a body to answer."""
    return not (len(frames) == 1 and frames[0] == b"")


_control_decoder = None


def servable(frames: list[bytes], kind: str) -> bool:
    """True for a frame the daemon would act on (a valid request, a known control command):
    the fuzzer sends only malformed ones."""
    body = frames[1:] if len(frames) >= 2 and frames[0] == b"" else frames
    if not body:
        return False
    if kind == "control":
        global _control_decoder
        from dynbatchd.control.commands import COMMANDS
        from dynbatchd.control.server import ControlRequest
        if _control_decoder is None:
            _control_decoder = msgspec.msgpack.Decoder(ControlRequest)
        try:
            request = P.decode_checked(_control_decoder, body[0], "control request", "args")
        except P.MalformedMessage:
            return False
        return request.cmd in COMMANDS
    from dynbatchd.transport import validate
    if sum(map(len, body)) > (1 << 20):
        return False
    try:
        request = P.decode_request(body[0])
    except P.MalformedMessage:
        return False
    return validate(request, body[1:]) is None and request.model in MODELS


class FrameMaker:
    """Malformed frames, drawn from a seeded generator: cheap enough for a million."""

    KINDS = ("junk", "cut", "flip", "insert", "wrong_types", "deep", "tensor", "extra_frames", "req_envelope",
             "bad_values", "empty")

    def __init__(self, seed: int, kind: str = "request"):
        self.rng = random.Random(seed)
        self.kind = kind
        r = self.rng
        if kind == "control":
            templates = [{"cmd": "ping"}, {"cmd": "status", "args": {}}, {"cmd": "tune", "args": {"channel": "x"}},
                         {"cmd": "config", "args": {}}]
        else:
            templates = [{"id": i, "model": "sim", "text": "hello world" * r.randint(0, 3)} for i in range(20)]
            templates += [{"id": f"s{i}", "model": "sim", "text": "x", "tags": ["urgent"], "deadline_ms": 100.0,
                           "tokens": 12, "tenant": "t", "user": "u"} for i in range(10)]
            templates += [{"id": i, "model": "sim", "tensor": {"dtype": "float32", "shape": [2, 2], "frame": 0}}
                          for i in range(10)]
        self.templates = [msgspec.msgpack.encode(t) for t in templates]
        self.wrong = [msgspec.msgpack.encode(self._wrong()) for _ in range(2000)]
        self.weights = [14, 12, 14, 8, 14, 6, 6, 6, 6, 10, 1] if kind == "request" else \
                       [18, 14, 18, 8, 18, 8, 0, 6, 4, 6, 1]
        self.made = Counter()

    def _value(self, depth: int = 0) -> Any:
        r = self.rng
        pick = r.randrange(9 if depth < 3 else 7)
        if pick == 0:
            return None
        if pick == 1:
            return r.random() < 0.5
        if pick == 2:
            return r.randint(-2 ** 63, 2 ** 64 - 1)
        if pick == 3:
            return r.choice((r.uniform(-1e300, 1e300), float("nan"), float("inf"), -0.0))
        if pick == 4:
            return "".join(chr(r.randrange(32, 0x2FF)) for _ in range(r.randrange(8)))
        if pick in (5, 6):
            return bytes(r.randrange(256) for _ in range(r.randrange(8)))
        if pick == 7:
            return [self._value(depth + 1) for _ in range(r.randrange(4))]
        return {str(r.randrange(100)): self._value(depth + 1) for _ in range(r.randrange(4))}

    def _wrong(self) -> dict[str, Any]:
        """Fields of the right names with values of the wrong types (or missing ones)."""
        r = self.rng
        keys = (["cmd", "args"] if self.kind == "control" else
                ["id", "model", "v", "text", "tensor", "value", "tags", "tokens", "priority", "deadline_ms", "tenant"])
        out = {k: self._value() for k in r.sample(keys, r.randint(1, len(keys)))}
        if self.kind == "control" and isinstance(out.get("cmd"), str):
            out["cmd"] += "?"
        return out

    def _bad_values(self) -> bytes:
        r = self.rng
        i = r.randrange(1 << 30)
        if self.kind == "control":
            return msgspec.msgpack.encode({"cmd": r.choice(["pong", "STATUS", "", "stop!", "tune "]),
                                           "args": {"channel": "standard"}})
        return msgspec.msgpack.encode(r.choice([
            {"id": i, "model": "sim", "text": "a", "deadline_ms": r.choice([float("inf"), float("nan"), -1.0, 1e12])},
            {"id": i, "model": "sim", "text": "a", "tokens": -r.randint(1, 99)},
            {"id": i, "model": "sim", "text": "a", "value": 1},
            {"id": i, "model": "sim"},
            {"id": i, "model": "sim", "text": "a", "v": r.randint(2, 99)},
            {"id": i, "model": "sim", "tensor": {"dtype": "complex64", "shape": [1], "frame": 0}},
            {"id": i, "model": "sim", "tensor": {"dtype": "float32", "shape": [-1], "frame": 0}},
            {"id": i, "model": "sim", "tensor": {"dtype": "uint8", "shape": [1], "frame": 3}},
        ]))

    def make(self) -> list[bytes]:
        r = self.rng
        kind = r.choices(self.KINDS, self.weights)[0]
        self.made[kind] += 1
        if kind == "junk":
            return [bytes(r.randrange(256) for _ in range(r.randrange(1, 48)))]
        if kind == "empty":
            return [b""]   # no body: must be dropped (counted), not answered
        if kind == "wrong_types":
            return [r.choice(self.wrong)]
        if kind == "bad_values":
            return [self._bad_values()]
        if kind == "deep":
            if self.kind == "control":
                head = b"\x82\xa3cmd\xa4ping\xa4args\x81\xa1x"
            else:
                head = b"\x83\xa2id" + bytes([r.randrange(128)]) + b"\xa5model\xa3sim\xa5value"
            return [head + r.choice((b"\x91", b"\x81\xa1k")) * r.randint(33, 5000) + b"\xc0"]
        if kind == "tensor":
            n = r.randint(1, 64)
            header = msgspec.msgpack.encode({"id": r.randrange(1 << 30), "model": "sim",
                                             "tensor": {"dtype": "float32", "shape": [n], "frame": 0}})
            return [header, b"\x00" * (4 * n + r.choice((-1, 1, 3)))]
        raw = bytearray(r.choice(self.templates))
        if kind == "cut":
            del raw[r.randrange(len(raw)):]
        elif kind == "flip":
            for _ in range(r.randint(1, 3)):
                raw[r.randrange(len(raw))] = r.randrange(256)
        elif kind == "insert":
            at = r.randrange(len(raw) + 1)
            raw[at:at] = bytes(r.randrange(256) for _ in range(r.randint(1, 6)))
        frames = [bytes(raw)]
        if kind == "extra_frames":
            frames = [bytes(raw[:r.randrange(len(raw))])] + [bytes(r.randrange(256) for _ in range(r.randrange(16)))
                                                             for _ in range(r.randint(1, 3))]
            if self.kind == "request" and r.random() < 0.01:   # over max_request_bytes (1 MiB), under MAXMSGSIZE
                frames.append(b"\x00" * ((1 << 20) + 1))
        if kind == "req_envelope":
            frames = [b""] + [bytes(raw[:r.randrange(len(raw))])]
        return frames

    def next(self) -> list[bytes]:
        for _ in range(20):
            frames = self.make()
            if not servable(frames, self.kind):
                return frames
        return [b"\xc1"]   # never a valid msgpack byte


def fuzz_sender(endpoint: str, kind: str, count: int, seed: int, window: int, time_limit_s: float,
                results: Any) -> None:
    """One process: `count` malformed frames, at most `window` unanswered at once; counts what came back."""
    maker = FrameMaker(seed, kind)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    for opt, val in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0)):
        sock.setsockopt(opt, val)
    sock.connect(endpoint)
    sent = no_body = replies = undecodable = 0
    codes: Counter = Counter()
    decode = P.reply_decoder.decode if kind == "request" else msgspec.msgpack.decode
    t0 = time.monotonic()
    deadline = t0 + time_limit_s

    def read(timeout_ms: int) -> None:
        nonlocal replies, undecodable
        if not sock.poll(timeout_ms):
            return
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            replies += 1
            header = frames[1] if frames[0] == b"" and len(frames) > 1 else frames[0]
            try:
                reply = decode(header)
            except Exception:
                undecodable += 1
                continue
            if kind == "request":
                codes["ok" if reply.ok else (reply.error.code if reply.error else "?")] += 1
            else:
                codes["ok" if isinstance(reply, dict) and reply.get("ok") else "error"] += 1

    i = 0
    while i < count and time.monotonic() < deadline:
        while i < count and sent - replies < window:
            frames = maker.next()
            sock.send_multipart(frames)
            i += 1
            if has_body(frames):
                sent += 1
            else:
                no_body += 1
        read(1000)
    send_s = time.monotonic() - t0
    drain_until = time.monotonic() + 30
    while replies < sent and time.monotonic() < drain_until:
        read(200)
    read(300)   # anything more would be a second answer
    sock.close(0)
    ctx.term()
    results.put({"seed": seed, "frames": i, "with_body": sent, "no_body": no_body, "replies": replies,
                 "undecodable_replies": undecodable, "codes": dict(codes), "send_s": round(send_s, 2),
                 "kinds": dict(maker.made), "stopped_by_time_limit": i < count})


class Monitor(threading.Thread):
    """Every `every_s`: a control ping and one valid request; records every failure and the worst latency."""

    def __init__(self, daemon: Daemon, every_s: float = 0.5):
        super().__init__(daemon=True)
        self.d, self.every_s = daemon, every_s
        self.stop = threading.Event()
        self.checks = self.failures = 0
        self.worst_ping_ms = self.worst_request_ms = 0.0
        self.rss: list[tuple[float, int]] = []   # (s since the monitor started, VmRSS bytes)
        self.notes: list[str] = []

    def run(self) -> None:
        t0 = time.monotonic()
        with Client(self.d.endpoint, timeout=10) as client:
            while not self.stop.is_set():
                self.checks += 1
                try:
                    t = time.perf_counter()
                    state = control_call(self.d.control, "ping", timeout_s=10)["state"]
                    self.worst_ping_ms = max(self.worst_ping_ms, (time.perf_counter() - t) * 1000)
                    t = time.perf_counter()
                    client.infer("sim", "monitor", deadline_ms=10_000)
                    self.worst_request_ms = max(self.worst_request_ms, (time.perf_counter() - t) * 1000)
                    if state != "serving" or not self.d.alive():
                        raise RuntimeError(f"state {state}, alive {self.d.alive()}")
                except Exception as exc:   # noqa: BLE001 - any failure is a finding
                    self.failures += 1
                    if len(self.notes) < 5:
                        self.notes.append(f"{type(exc).__name__}: {exc}")
                try:
                    self.rss.append((time.monotonic() - t0, self.d.rss()))
                except OSError:
                    pass
                self.stop.wait(self.every_s)


def fuzz_socket(daemon: Daemon, kind: str, frames: int, senders: int, time_limit_s: float, seed: int) -> dict[str, Any]:
    endpoint = daemon.endpoint if kind == "request" else daemon.control
    window = 1000 if kind == "request" else 200   # the control socket's send queue holds 1000 (ZeroMQ's default)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    per = [frames // senders + (1 if i < frames % senders else 0) for i in range(senders)]
    before = daemon.status()["daemon"]
    t0 = time.monotonic()
    procs = [ctx.Process(target=fuzz_sender, args=(endpoint, kind, per[i], seed + i, window, time_limit_s, results))
             for i in range(senders)]
    for p in procs:
        p.start()
    got = []
    give_up = time.monotonic() + time_limit_s + 120
    while len(got) < senders and time.monotonic() < give_up:
        try:
            got.append(results.get(timeout=1.0))
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and results.empty():
                break   # a sender died without reporting (its traceback is on stderr)
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    wall = time.monotonic() - t0
    after = daemon.status()["daemon"]
    total = lambda key: sum(g[key] for g in got)   # noqa: E731
    codes: Counter = Counter()
    kinds: Counter = Counter()
    for g in got:
        codes.update(g["codes"])
        kinds.update(g["kinds"])
    out = {"socket": kind, "senders": senders, "senders_reported": len(got), "frames": total("frames"),
           "with_body": total("with_body"), "no_body": total("no_body"), "replies": total("replies"),
           "undecodable_replies": total("undecodable_replies"), "reply_codes": dict(codes), "kinds": dict(kinds),
           "wall_s": round(wall, 1), "frames_per_s": round(total("frames") / wall) if wall else 0,
           "stopped_by_time_limit": any(g["stopped_by_time_limit"] for g in got)}
    if kind == "request":
        out["daemon_bad_requests"] = after["bad_requests"] - before["bad_requests"]
        out["daemon_dropped"] = after["dropped"] - before["dropped"]
        out["daemon_replies_undelivered"] = after["replies_undelivered"] - before["replies_undelivered"]
    out["all_answered_once"] = (len(got) == senders and out["replies"] == out["with_body"]
                                and out["undecodable_replies"] == 0 and not out["stopped_by_time_limit"]
                                and out["frames"] == frames)
    if kind == "request":
        out["all_answered_once"] = out["all_answered_once"] and out["daemon_dropped"] == out["no_body"]
    return out


def bench_fuzz(frames: int, control_frames: int, senders: int, time_limit_s: float, log=print) -> dict[str, Any]:
    log(f"\n== 2. Fuzzing: {frames:,} malformed frames at the request socket, {control_frames:,} at the control "
        f"socket ({senders} sender processes each) ==")
    with tempfile.TemporaryDirectory(prefix="dynbatchd-rel-") as tmp:
        daemon = start(Path(tmp), "fuzz")
        try:
            with Client(daemon.endpoint) as client:
                for _ in range(20):
                    client.infer("sim", "warm")
            rss_cold = daemon.rss()
            # A warm-up burst (5% more frames, at least 10,000; other seeds) before the baseline: what the allocators
            # and ZeroMQ's queues take while busy is working set, not growth.
            warmup = [fuzz_socket(daemon, kind, max(10_000, n // 20), 1, time_limit_s, seed=seed)
                      for kind, n, seed in (("request", frames, 90), ("control", control_frames, 91))]
            rss_start = daemon.rss()
            monitor = Monitor(daemon)
            monitor_t0 = time.monotonic()
            monitor.start()
            req = fuzz_socket(daemon, "request", frames, senders, time_limit_s, seed=1000)
            rss_mid = daemon.rss()
            req_s = time.monotonic() - monitor_t0
            log(f"request socket: {req['frames']:,} frames in {req['wall_s']} s ({req['frames_per_s']:,}/s); "
                f"{req['with_body']:,} with a body, {req['replies']:,} replies ({req['reply_codes']}); "
                f"{req['no_body']} without a body, daemon counted {req['daemon_dropped']} dropped; "
                f"replies undelivered {req['daemon_replies_undelivered']}")
            ctl = fuzz_socket(daemon, "control", control_frames, senders, time_limit_s, seed=5000)
            log(f"control socket: {ctl['frames']:,} frames in {ctl['wall_s']} s ({ctl['frames_per_s']:,}/s); "
                f"{ctl['with_body']:,} with a body, {ctl['replies']:,} replies ({ctl['reply_codes']})")
            monitor.stop.set()
            monitor.join(30)
            rss_end = daemon.rss()
            alive = daemon.alive() and daemon.ping()["state"] == "serving"
        finally:
            code = daemon.stop(60)
    growth = pct(rss_end - rss_start, rss_start)
    # VmRSS once a tenth of the request-socket run was through: what the allocators settled at
    warm = next((b for t, b in monitor.rss if t >= 0.1 * req_s), rss_mid)
    series = monitor.rss[::max(1, len(monitor.rss) // 12)] + monitor.rss[-1:]
    out = {"request": req, "control": ctl, "rss_cold_mb": round(rss_cold / 2 ** 20, 1),
           "warmup_frames": {w["socket"]: w["frames"] for w in warmup},
           "warmup_all_answered_once": all(w["all_answered_once"] for w in warmup),
           "rss_start_mb": round(rss_start / 2 ** 20, 1),
           "rss_after_request_fuzz_mb": round(rss_mid / 2 ** 20, 1), "rss_end_mb": round(rss_end / 2 ** 20, 1),
           "rss_peak_mb": round(max([b for _, b in monitor.rss] + [rss_end]) / 2 ** 20, 1),
           "rss_growth_pct": round(growth, 2), "rss_after_first_tenth_mb": round(warm / 2 ** 20, 1),
           "rss_growth_after_first_tenth_pct": round(pct(rss_end - warm, warm), 2),
           "rss_series_mb": [(round(t, 1), round(b / 2 ** 20, 1)) for t, b in series],
           "monitor": {"checks": monitor.checks, "failures": monitor.failures, "notes": monitor.notes,
                       "worst_ping_ms": round(monitor.worst_ping_ms, 1),
                       "worst_request_ms": round(monitor.worst_request_ms, 1)},
           "alive_at_end": alive, "daemon_exit": code, "trouble": daemon.trouble[:10]}
    out["met"] = (req["all_answered_once"] and ctl["all_answered_once"] and out["warmup_all_answered_once"] and ctl["reply_codes"].get("ok", 0) == 0
                  and req["reply_codes"].get("ok", 0) == 0 and monitor.failures == 0 and alive and growth < 5.0)
    log(f"daemon up throughout: {monitor.checks} checks (ping + one request every 0.5 s), {monitor.failures} failed; "
        f"worst ping {out['monitor']['worst_ping_ms']} ms, worst request {out['monitor']['worst_request_ms']} ms")
    log(f"VmRSS: {out['rss_cold_mb']} MiB idle before any frame; after a warm-up burst of "
        f"{out['warmup_frames']['request']:,} + {out['warmup_frames']['control']:,} frames (all answered: "
        f"{out['warmup_all_answered_once']}) {out['rss_start_mb']} MiB at the start, "
        f"{out['rss_after_first_tenth_mb']} after the first tenth of the "
        f"request-socket run, {out['rss_after_request_fuzz_mb']} after it, {out['rss_end_mb']} at the end (peak "
        f"{out['rss_peak_mb']}): {growth:+.2f}% from the start, {out['rss_growth_after_first_tenth_pct']:+.2f}% "
        f"from the first tenth")
    log("VmRSS over time (s, MiB): " + ", ".join(f"{t:g}: {m:g}" for t, m in out["rss_series_mb"]))
    log(f"goals (every frame with a body answered once, up throughout, RSS growth < 5%): "
        f"{'MET' if out['met'] else 'MISSED'}")
    return out


# ---------------------------------------------------------------------------
# 3. repeated overload
# ---------------------------------------------------------------------------

@dataclass
class Round:
    on_time_rt: float
    rt_offered: int
    rt_outcomes: dict[str, int]
    std_outcomes: dict[str, int]
    achieved_ok_rps: float
    idle_p99_ms: float
    normal_ms: float
    recovered_s: float | None
    rss_mb: tuple[float, float, float]   # start, peak, end
    send_lag_p99_ms: float
    daemon_cores: float                  # the daemon process's CPU over the round (its event loop is one thread)
    workers_cores: float
    other_cores: float                   # what the rest of the machine used meanwhile (not this benchmark's)
    rt_missed_per_5s: list[int]          # realtime requests not on time, by when they were due
    rt_late_ms: dict[str, float]         # latency of realtime requests answered ok but late


class RssSampler(threading.Thread):
    def __init__(self, pid: int, every_s: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.every_s = pid, every_s
        self.samples: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.samples.append(vm_rss_bytes(self.pid))
            except OSError:
                return
            self.stop.wait(self.every_s)


def overload_round(daemon: Daemon, seconds: float, factor: float, seed: int) -> Round:
    """idle probes (2 s) -> factor x capacity for `seconds` -> probes (3 s), one schedule, one generator."""
    rng = np.random.default_rng(seed)
    pre, post, probe_every = 2.0, 3.0, 0.02
    pre_t = np.arange(0.0, pre, 0.05)
    load_t = pre + loadgen.schedule(factor * CAPACITY_RPS, seconds, seed)
    end = pre + seconds
    post_t = end + np.arange(0.0, post, probe_every)
    offsets = np.concatenate([pre_t, load_t, post_t])
    n_pre, n_load = len(pre_t), len(load_t)
    load_headers, urgent = mixed_headers(n_load, rng)
    headers = [build_request(i + 1, "sim", "idle probe")[0] for i in range(n_pre)]
    headers += [build_request(n_pre + i + 1, "sim", "reliability probe text",
                              tags=("urgent",) if urgent[i] else ())[0] for i in range(n_load)]
    headers += [build_request(n_pre + n_load + i + 1, "sim", "after probe")[0] for i in range(len(post_t))]
    rss0 = daemon.rss()
    sampler = RssSampler(daemon.pid)
    sampler.start()
    cpu0, busy0, own0 = daemon.cpu(), machine_busy_s(), time.process_time()
    sent = loadgen.send_open_loop(daemon.endpoint, offsets, headers, drain_s=5.0)
    cpu1, busy1, own1 = daemon.cpu(), machine_busy_s(), time.process_time()
    sampler.stop.set()
    sampler.join(5)
    rss1 = daemon.rss()
    wall = cpu1.at - cpu0.at
    d_cpu, w_cpu = cpu1.daemon_s - cpu0.daemon_s, cpu1.workers_s - cpu0.workers_s
    other = max(0.0, (busy1 - busy0) - d_cpu - w_cpu - (own1 - own0)) / wall
    lat = sent.latency_ms()
    codes = [sent.code(i) for i in range(len(offsets))]
    idle = lat[:n_pre][sent.ok[:n_pre]]
    idle_p99 = float(np.percentile(idle, 99)) if len(idle) else float("inf")
    normal = max(2 * idle_p99, idle_p99 + 20.0)
    load = slice(n_pre, n_pre + n_load)
    rt_idx = np.flatnonzero(urgent) + n_pre
    std_idx = np.flatnonzero(~urgent) + n_pre
    rt_on_time = sum(1 for i in rt_idx if sent.ok[i] and lat[i] <= RT_DEADLINE_MS)
    missed = [i for i in rt_idx if not (sent.ok[i] and lat[i] <= RT_DEADLINE_MS)]
    per_5s = np.bincount(((sent.offsets[missed] - pre) // 5).astype(int).clip(0),
                         minlength=int(np.ceil(seconds / 5))).tolist() if missed else [0] * int(np.ceil(seconds / 5))
    late = np.array([lat[i] for i in missed if sent.ok[i]])
    # recovery: the first probe after the load from which on every probe is normal; recovered when it was answered
    post_idx = range(n_pre + n_load, len(offsets))
    normal_flags = [bool(sent.ok[i] and lat[i] <= normal) for i in post_idx]
    recovered = None
    for j in range(len(normal_flags)):
        if all(normal_flags[j:]):
            i = n_pre + n_load + j
            recovered = max(0.0, float(sent.offsets[i] + lat[i] / 1000.0 - end))
            break
    window = (sent.done[load] >= pre + 0.5) & (sent.done[load] <= end) & sent.ok[load]
    return Round(
        on_time_rt=pct(rt_on_time, len(rt_idx)), rt_offered=len(rt_idx),
        rt_outcomes=dict(Counter(codes[i] for i in rt_idx)), std_outcomes=dict(Counter(codes[i] for i in std_idx)),
        achieved_ok_rps=round(float(window.sum()) / (seconds - 0.5), 1), idle_p99_ms=round(idle_p99, 2),
        normal_ms=round(normal, 2), recovered_s=None if recovered is None else round(recovered, 3),
        rss_mb=(round(rss0 / 2 ** 20, 1), round(max(sampler.samples + [rss0, rss1]) / 2 ** 20, 1),
                round(rss1 / 2 ** 20, 1)),
        send_lag_p99_ms=round(float(np.percentile(sent.sent_lag, 99)) * 1000, 2),
        daemon_cores=round(d_cpu / wall, 3), workers_cores=round(w_cpu / wall, 3), other_cores=round(other, 3),
        rt_missed_per_5s=per_5s,
        rt_late_ms={"count": int(len(late)), "p50": round(float(np.percentile(late, 50)), 1) if len(late) else 0.0,
                    "max": round(float(late.max()), 1) if len(late) else 0.0})


def bench_overload(rounds: int, seconds: float, factor: float = 3.0, log=print) -> dict[str, Any]:
    log(f"\n== 3. Overload: {factor:g}x capacity ({factor * CAPACITY_RPS:.0f} req/s offered, capacity "
        f"{CAPACITY_RPS:.0f} req/s with full batches of {STD_BATCH} on {DEVICES} {SIM} devices, "
        f"{REALTIME_SHARE:.0%} realtime) for {seconds:g} s, {rounds} round(s) on one daemon ==")
    out_rounds = []
    with tempfile.TemporaryDirectory(prefix="dynbatchd-rel-") as tmp:
        daemon = start(Path(tmp), "overload")
        try:
            for k in range(rounds):
                r = overload_round(daemon, seconds, factor, seed=100 + k)
                out_rounds.append(r.__dict__)
                log(f"round {k + 1}: realtime on time {r.on_time_rt:.3f}% of {r.rt_offered} ({r.rt_outcomes}); "
                    f"standard {r.std_outcomes}; ok {r.achieved_ok_rps:.0f} req/s; normal again "
                    f"{'never' if r.recovered_s is None else f'{r.recovered_s:.3f} s'} after the load "
                    f"(normal: <= {r.normal_ms} ms, idle p99 {r.idle_p99_ms} ms); VmRSS start/peak/end "
                    f"{r.rss_mb[0]}/{r.rss_mb[1]}/{r.rss_mb[2]} MiB; send lag p99 {r.send_lag_p99_ms} ms")
                log(f"         CPU: daemon {r.daemon_cores} cores, workers {r.workers_cores}, the rest of the machine "
                    f"{r.other_cores}; realtime late but ok: {r.rt_late_ms}; realtime misses per 5 s: "
                    f"{r.rt_missed_per_5s}")
            status = daemon.status()
        finally:
            code = daemon.stop(60)
    first_peak, last_peak = out_rounds[0]["rss_mb"][1], out_rounds[-1]["rss_mb"][1]
    rss_growth = pct(last_peak - first_peak, first_peak)
    on_time_met = all(r["on_time_rt"] >= 99.9 for r in out_rounds)
    recovery_met = all(r["recovered_s"] is not None and r["recovered_s"] <= 1.0 for r in out_rounds)
    out = {"factor": factor, "seconds": seconds, "rounds": out_rounds, "capacity_rps": round(CAPACITY_RPS, 1),
           "rss_peak_growth_pct_first_to_last": round(rss_growth, 2), "daemon_exit": code,
           "deadline_misses": {n: c.get("deadline_misses") for n, c in status["channels"].items()},
           "trouble": daemon.trouble[:10],
           "on_time_met": on_time_met, "recovery_met": recovery_met, "rss_met": rss_growth < 5.0}
    out["met"] = on_time_met and recovery_met and out["rss_met"]
    log(f"realtime on time >= 99.9% every round: {'MET' if on_time_met else 'MISSED'}; normal within 1 s: "
        f"{'MET' if recovery_met else 'MISSED'}; VmRSS peak, last round vs first: {rss_growth:+.2f}% "
        f"({'MET' if out['rss_met'] else 'MISSED'}, goal < 5%)")
    return out


# ---------------------------------------------------------------------------

def commit() -> str:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "dynbatchd", "plugins")
    return head + (" (daemon sources modified)" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.reliability", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 kills, 50,000 + 5,000 frames, one 10 s overload")
    ap.add_argument("--only", default="kills,fuzz,overload", help="comma list of: kills, fuzz, overload")
    ap.add_argument("--kills", type=int, default=None, help="worker SIGKILLs (default 10; quick 2)")
    ap.add_argument("--frames", type=int, default=None, help="malformed frames at the request socket (1,000,000)")
    ap.add_argument("--control-frames", type=int, default=None, help="at the control socket (100,000)")
    ap.add_argument("--senders", type=int, default=max(1, min(4, (os.cpu_count() or 2) - 1)),
                    help="parallel sender processes per socket")
    ap.add_argument("--rounds", type=int, default=None, help="overload rounds (5; quick 1)")
    ap.add_argument("--seconds", type=float, default=None, help="seconds per overload round (60; quick 10)")
    ap.add_argument("--fuzz-time-limit", type=float, default=600.0, help="most seconds a fuzz sender may send")
    ap.add_argument("--json", default=str(RESULTS / "reliability.json"), help="where to write the figures")
    args = ap.parse_args(argv)
    q = args.quick
    kills = args.kills if args.kills is not None else (2 if q else 10)
    frames = args.frames if args.frames is not None else (50_000 if q else 1_000_000)
    control_frames = args.control_frames if args.control_frames is not None else (5_000 if q else 100_000)
    rounds = args.rounds if args.rounds is not None else (1 if q else 5)
    seconds = args.seconds if args.seconds is not None else (10.0 if q else 60.0)
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    command = "python -m benchmarks.reliability" + "".join(
        " " + shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"command: {command}")
    print(f"commit {commit()}; {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}; "
          f"devices are {SIM} ({BASE_MS:g} ms + {PER_ITEM_MS:g} ms/item, a sleep in each worker)")
    doc: dict[str, Any] = {"command": command, "commit": commit(), "cores": os.cpu_count(), "simulated": True,
                           "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
    t0 = time.monotonic()
    if "kills" in only:
        doc["kills"] = bench_kills(kills)
    if "fuzz" in only:
        doc["fuzz"] = bench_fuzz(frames, control_frames, args.senders, args.fuzz_time_limit)
    if "overload" in only:
        doc["overload"] = bench_overload(rounds, seconds)
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    met = all(doc[k]["met"] for k in ("kills", "fuzz", "overload") if k in doc)
    doc["met"] = met
    print(f"\nall goals: {'MET' if met else 'MISSED'}; {doc['wall_s']} s; command: {command}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, default=str))
        print(f"figures written to {path}")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
