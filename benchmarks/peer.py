"""dynbatchd beside a peer server (Mosec), same model code, same HTTP load: goodput at the SLO (issue 30).

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks.peer                  # all three workloads, ~15-25 min
    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks.peer --quick --only sim100
    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks.peer --only minilm250 --duration 6

Mosec is not a dependency of the project: without it this prints how to install it and exits 0.

Per workload (`WORKLOADS`), all servers are started first and stay up together: one Mosec per
`max_wait_time` tried (`benchmarks/peer_mosec.py`: one worker, `max_batch_size` 32, dynbatchd's
own runner) and one dynbatchd (`slo` window, channel deadline = the SLO, max_batch 32,
cpu_threads 1, `[http] listen`). Each side (every Mosec, dynbatchd over HTTP, dynbatchd over
ZeroMQ) searches for goodput with `goodput.find_goodput`, the searches taking turns run by run
(`Turns`), so that a change in the machine's other load falls on every side alike. HTTP sides
get the same bytes from `benchmarks/peer_http.py`; the ZeroMQ side gets `benchmarks/loadgen.py`.
Before each run: wait (up to `--quiet-wait` s) for the machine to be quiet, and (up to 10 s)
for every server of the workload to be idle (the last run's backlog drained). A failed run
during which others used > 0.5 cores is run once more. Goodput counts only when confirmed: the
highest passing rate passes again with another seed (up to three candidates, highest first).
The model's limit is `benchmarks/peer_limit.py` in a child process (the runner alone, batches
of 32, best of five ~1.5 s repeats). Mean batch is per batch (requests / batches): dynbatchd's
`status` counters, Mosec's from the `batch_size` each reply carries (requests / sum of 1/size).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import psutil

from benchmarks import loadgen, peer_http
from benchmarks.goodput import Search, find_goodput
from benchmarks.harness import REPO, Daemon, config_text, free_port, machine_busy_s, wait_for_quiet, wait_until
from benchmarks.run_all import environment
from benchmarks.scenarios import MINILM, SIM_LIMIT, SIMULATED, TEXTS, slo_channel

RESULTS = REPO / "benchmarks" / "results"
NOISY_CORES = 0.5       # a failed run during which others used more than this is run once more
MIN_REQUESTS = 1000     # low-rate runs last longer (up to 3x) so that p99 rests on enough requests
MAX_BATCH = 32
THREADS = "1"
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass
class Workload:
    key: str
    title: str
    model: str                 # "minilm" or "sim" (benchmarks.peer_limit.MODELS)
    slo_ms: float
    start: float               # first offered rate, as a share of the model's limit
    factor: float
    probes: int
    waits: tuple[int, ...]     # Mosec max_wait_time values tried (ms)
    refine: int = 2
    ceiling: float | None = None   # share of the limit never exceeded

    @property
    def simulated(self) -> bool:
        return self.model == "sim"


# Mosec's README: "Normally, max_wait_time should be less than the batch inference time" (MiniLM
# batch of 32 here: ~90-150 ms; the simulated device: 24 ms); its default is 10 ms.
WORKLOADS = {
    "minilm250": Workload("minilm250", "MiniLM, 1 torch thread, p99 <= 250 ms", "minilm", 250.0,
                          start=0.8, factor=1.1, probes=5, waits=(10, 40, 80)),
    "minilm50": Workload("minilm50", "MiniLM, 1 torch thread, p99 <= 50 ms", "minilm", 50.0,
                         start=0.4, factor=1.35, probes=6, waits=(5, 10)),
    "sim100": Workload("sim100", "device 8 ms + 0.5 ms/item, p99 <= 100 ms", "sim", 100.0,
                       start=0.85, factor=1.04, probes=4, waits=(10, 20), ceiling=1.05),
}
MODEL_SPECS = {"minilm": MINILM, "sim": SIMULATED}


# ---------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------

def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of `pid` and all its descendants so far."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class MosecServer:
    """`python -m benchmarks.peer_mosec` on 127.0.0.1:port, its log in `log`."""

    def __init__(self, model: str, wait_ms: int, directory: str):
        self.model, self.wait_ms, self.port = model, wait_ms, free_port()
        self.log = Path(directory) / f"mosec-w{wait_ms}.log"
        self.proc: subprocess.Popen | None = None
        self.command = [sys.executable, "-m", "benchmarks.peer_mosec", "--address", "127.0.0.1",
                        "--port", str(self.port), "--log-level", "warning", "--timeout", "10000"]
        self.env = {**os.environ, **ENV, "PEER_MODEL": model, "PEER_MAX_BATCH": str(MAX_BATCH),
                    "PEER_WAIT_MS": str(wait_ms), "PEER_THREADS": THREADS}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self, timeout_s: float = 240.0) -> "MosecServer":
        out = self.log.open("wb")
        self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                     stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True)

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Mosec exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                body = json.dumps({"model": self.model, "input": "warm up"}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{self.port}{'/v1/embeddings'}", data=body)
                with urllib.request.urlopen(req, timeout=5) as reply:
                    return reply.status == 200
            except OSError:
                return False
        try:
            wait_until(ready, timeout_s, 0.3, message=f"Mosec (wait {self.wait_ms} ms) not serving")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)   # Mosec's graceful shutdown; its workers follow
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)   # its own session: the server and its workers only
            self.proc.wait(5)


HEADROOM: float | None = None   # --headroom: the slo window's opt-in near-saturation rule, for an A/B


def dynbatchd_daemon(model: str, slo_ms: float, directory: str) -> tuple[Daemon, int]:
    """The documented throughput settings (scenarios.slo_channel: `slo` window, deadline = SLO),
    max_batch 32, cpu_threads 1, with the HTTP door on a free loopback port."""
    port = free_port()
    text = config_text(directory, {model: MODEL_SPECS[model]}, slo_channel(MAX_BATCH, slo_ms, HEADROOM),
                       cpu_threads=1)
    text += f'\n[http]\nlisten = "127.0.0.1:{port}"\n'
    d = Daemon(Path(directory) / "dynbatchd.toml", f"ipc://{directory}/req.sock", f"ipc://{directory}/ctl.sock",
               config_text=text, log=Path(directory) / "dynbatchd.log", env=ENV, name="dynbatchd (peer)")
    return d, port


def model_limit(model: str, repeats: int = 5, seconds: float = 1.5) -> dict[str, Any]:
    """benchmarks.peer_limit in a child with the workers' thread settings."""
    env = {**os.environ, **ENV, "OMP_NUM_THREADS": THREADS, "MKL_NUM_THREADS": THREADS}
    out = subprocess.run([sys.executable, "-m", "benchmarks.peer_limit", model, "--repeats", str(repeats),
                          "--seconds", str(seconds)], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"benchmarks.peer_limit {model} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------
# sides and their turns
# ---------------------------------------------------------------------------

@dataclass
class Side:
    name: str                  # "Mosec wait 10 ms", "dynbatchd HTTP", "dynbatchd ZeroMQ"
    kind: str                  # "mosec", "http", "zmq"
    pid: int
    send: Callable[[float, float, int], loadgen.RunResult]   # (rate, duration_s, seed) -> result
    counters: Callable[[], tuple[int, int]] | None = None    # (completed, batches): dynbatchd's status
    wait_ms: int | None = None
    search: Search | None = None
    confirmed: float = 0.0
    confirmations: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


class Turns:
    """Sides take turns, one run each, round robin; a side that is done leaves the ring."""

    def __init__(self, names: list[str]):
        self.ring = list(names)
        self.at = 0
        self.cond = threading.Condition()

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        with self.cond:
            self.cond.wait_for(lambda: self.ring[self.at % len(self.ring)] == name)
        try:
            return fn()
        finally:
            with self.cond:
                self.at = (self.ring.index(name) + 1) % len(self.ring)
                self.cond.notify_all()

    def leave(self, name: str) -> None:
        with self.cond:
            i = self.ring.index(name)
            current = self.ring[self.at % len(self.ring)]
            self.ring.pop(i)
            if self.ring:
                self.at = 0 if current == name and i >= len(self.ring) else (
                    i if current == name else self.ring.index(current))
            self.cond.notify_all()


def wait_idle(pids: list[int], max_s: float = 10.0, cores: float = 0.15, sample_s: float = 0.3) -> float:
    """Wait until the servers `pids` (with their workers) use < `cores` together; the last figure."""
    deadline = time.monotonic() + max_s
    while True:
        c0, t0 = sum(map(tree_cpu_s, pids)), time.monotonic()
        time.sleep(sample_s)
        busy = (sum(map(tree_cpu_s, pids)) - c0) / (time.monotonic() - t0)
        if busy < cores or time.monotonic() >= deadline:
            return round(busy, 3)


class Bench:
    """One workload's sides, all servers up, searches in turns."""

    def __init__(self, wl: Workload, limit: float, duration_s: float, quick: bool, quiet_wait_s: float, log=print):
        self.wl, self.limit, self.duration_s, self.quick, self.quiet_wait_s = wl, limit, duration_s, quick, quiet_wait_s
        self.log = log
        self.sides: list[Side] = []
        self.pids: list[int] = []
        self.seeds = iter(range(5000, 100000))
        self.lock = threading.Lock()

    def measure(self, side: Side, rate: float) -> tuple[loadgen.RunResult, dict[str, Any]]:
        background = wait_for_quiet(self.quiet_wait_s) if self.quiet_wait_s > 0 else None
        drained = wait_idle(self.pids)
        duration = min(max(self.duration_s, MIN_REQUESTS / rate), 3 * self.duration_s)
        with self.lock:
            seed = next(self.seeds)
        k0 = side.counters() if side.counters else None
        busy0, mine0 = machine_busy_s(), sum(map(tree_cpu_s, self.pids))
        s0 = tree_cpu_s(side.pid)
        r = side.send(rate, duration, seed)
        s1, mine1, busy1 = tree_cpu_s(side.pid), sum(map(tree_cpu_s, self.pids)), machine_busy_s()
        wall = r.elapsed_s
        gen_s = r.gen_cpu_frac * wall
        extra: dict[str, Any] = {
            "background_cores_before": background, "servers_cores_before": drained,
            "server_cores": round((s1 - s0) / wall, 3), "generator_cores": r.gen_cpu_frac,
            "other_cores": round(max(0.0, (busy1 - busy0) - (mine1 - mine0) - gen_s) / wall, 3), "seed": seed}
        if side.counters:
            k1 = side.counters()
            done, batches = k1[0] - k0[0], k1[1] - k0[1]
            extra["mean_batch"] = round(done / batches, 2) if batches else 0.0
        else:   # Mosec: from the batch_size its replies carry
            extra["mean_batch"] = r.extra.get("per_batch_mean", 0.0)
        return r, extra

    def measure_noisy(self, side: Side, rate: float) -> tuple[loadgen.RunResult, dict[str, Any]]:
        r, extra = self.measure(side, rate)
        if not r.passes(self.wl.slo_ms) and extra["other_cores"] > NOISY_CORES and self.quiet_wait_s > 0:
            self.log(f"    [{side.name}] {rate:g} req/s failed while others used {extra['other_cores']} cores: again")
            first = {"result": r.to_dict(), "cpu": extra}
            r, extra = self.measure(side, rate)
            extra["discarded_noisy_run"] = first
        return r, extra

    def run_side(self, side: Side, turns: Turns) -> None:
        wl = self.wl
        try:
            def measure(rate: float):
                return turns.run(side.name, lambda: self.measure_noisy(side, rate))

            def log(line: str) -> None:
                self.log(f"  [{side.name}]{line}")
            side.search = find_goodput(measure, slo_ms=wl.slo_ms, start=wl.start * self.limit, factor=wl.factor,
                                       probes=wl.probes, refine=1 if self.quick else wl.refine,
                                       ceiling=wl.ceiling * self.limit if wl.ceiling else None, log=log)
            passing = sorted({t[0] for t in side.search.trials if side.search.passed(t[1])}, reverse=True)
            for rate in passing[:3]:
                r, extra = measure(rate)
                ok = r.passes(wl.slo_ms)
                side.confirmations.append({"rate": rate, "pass": ok, "result": r.to_dict(), "cpu": extra})
                log(f" confirm {rate:>9.1f} req/s -> {r.achieved_rps:>9.1f} ok/s  p99 {r.p99_ms:>9.2f} ms  errors "
                    f"{r.error_count:>5}  batch {extra['mean_batch']:>5.1f}  others {extra['other_cores']:.2f} cores  "
                    f"{'PASS' if ok else 'fail'}")
                if ok:
                    side.confirmed = rate
                    break
        except Exception as exc:   # a side that breaks is reported, the others go on
            side.error = f"{type(exc).__name__}: {exc}"
            self.log(f"  [{side.name}] FAILED: {side.error}")
        finally:
            turns.leave(side.name)

    def run(self) -> None:
        turns = Turns([s.name for s in self.sides])
        threads = [threading.Thread(target=self.run_side, args=(s, turns), name=s.name) for s in self.sides]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def http_sender(port: int, model: str, simulated: bool) -> Callable[[float, float, int], loadgen.RunResult]:
    """The same bytes to any server: `POST /v1/embeddings` of one text (scenarios.TEXTS, round robin)."""
    requests = peer_http.embedding_requests("/v1/embeddings", "127.0.0.1", model, TEXTS)

    def send(rate: float, duration_s: float, seed: int) -> loadgen.RunResult:
        return peer_http.run("127.0.0.1", port, requests, rate, duration_s, seed=seed, drain_s=3.0,
                             pool=min(256, int(rate * 0.1) + 16), simulated=simulated)
    return send


def run_workload(wl: Workload, limit: float, args: argparse.Namespace, log=print) -> dict[str, Any]:
    log(f"\n== {wl.key}: {'SIMULATED ' if wl.simulated else ''}{wl.title}; model's limit {limit:,.1f} req/s; Mosec max_wait_time "
        f"{', '.join(map(str, wl.waits))} ms")
    t0 = time.monotonic()
    bench = Bench(wl, limit, args.duration, args.quick, args.quiet_wait, log)
    servers: list[Any] = []
    with tempfile.TemporaryDirectory(prefix=f"dynbatchd-peer-{wl.key}-") as tmp:
        try:
            for wait in wl.waits:
                m = MosecServer(wl.model, wait, tmp).start()
                servers.append(m)
                send = http_sender(m.port, wl.model, wl.simulated)
                bench.sides.append(Side(f"Mosec wait {wait} ms", "mosec", m.pid, send, wait_ms=wait))
            sock_dir = tempfile.mkdtemp(prefix="d-", dir=tmp)
            daemon, port = dynbatchd_daemon(wl.model, wl.slo_ms, sock_dir)
            daemon.start(240.0)
            servers.append(daemon)

            def counters() -> tuple[int, int]:
                ch = daemon.status()["channels"]["bench"]
                return ch["completed"], ch["batches"]
            bench.sides.append(Side("dynbatchd HTTP", "http", daemon.pid,
                                    http_sender(port, wl.model, wl.simulated), counters))
            if not args.no_zmq:
                def zmq_send(rate: float, duration_s: float, seed: int) -> loadgen.RunResult:
                    return loadgen.run(daemon.endpoint, wl.model, rate, duration_s, inputs=TEXTS, seed=seed,
                                       drain_s=wl.slo_ms / 1000 + 3.0)
                bench.sides.append(Side("dynbatchd ZeroMQ", "zmq", daemon.pid, zmq_send, counters))
            bench.pids = sorted({s.pid for s in bench.sides})
            log(f"   servers up after {time.monotonic() - t0:.0f} s; idle together: {wait_idle(bench.pids, 3.0)} cores")
            for side in bench.sides:   # warm every path up
                side.send(max(10.0, 0.2 * limit), 1.0, 999)
            bench.run()
        finally:
            for s in servers:
                try:
                    s.stop()
                except Exception as exc:   # noqa: BLE001 - report, stop the rest
                    log(f"   stopping {s}: {exc}")
        trouble = getattr(servers[-1], "trouble", []) if servers else []
    return {"workload": wl.key, "title": wl.title, "model": wl.model, "slo_ms": wl.slo_ms, "limit_rps": limit,
            "simulated": wl.simulated, "waits_ms": list(wl.waits), "wall_s": round(time.monotonic() - t0, 1),
            "dynbatchd_trouble": trouble, "sides": [side_doc(s) for s in bench.sides]}


def side_doc(s: Side) -> dict[str, Any]:
    def trial(rate: float, r: loadgen.RunResult, extra: dict[str, Any]) -> dict[str, Any]:
        return {"rate": rate, "pass": s.search.passed(r), "result": r.to_dict(), "cpu": extra}
    at = next((c for c in s.confirmations if c["pass"]), None)
    return {"name": s.name, "kind": s.kind, "wait_ms": s.wait_ms, "confirmed_rps": s.confirmed, "error": s.error,
            "best_single_rps": s.search.goodput if s.search else 0.0,
            "at_confirmed": at, "trials": [trial(*t) for t in s.search.trials] if s.search else [],
            "confirmations": s.confirmations}


# ---------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------

def best_peer(w: dict[str, Any]) -> dict[str, Any] | None:
    peers = [s for s in w["sides"] if s["kind"] == "mosec"]
    return max(peers, key=lambda s: (s["confirmed_rps"], s["best_single_rps"])) if peers else None


def side_named(w: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((s for s in w["sides"] if s["kind"] == kind), None)


def cell(s: dict[str, Any] | None, limit: float, wait: bool = False) -> str:
    if s is None:
        return "-"
    if s["error"]:
        return f"failed: {s['error'][:60]}"
    tail = f", wait {s['wait_ms']} ms" if wait else ""
    if not s["confirmed_rps"]:
        single = s["best_single_rps"]
        return f"**none confirmed** (one pass at {single:,.1f}){tail}" if single else f"none passed{tail}"
    batch = s["at_confirmed"]["cpu"]["mean_batch"]
    return f"{s['confirmed_rps']:,.1f} ({s['confirmed_rps'] / limit:.2f}), batch {batch:.1f}{tail}"


def others(w: dict[str, Any]) -> list[float]:
    runs = [t["cpu"] for s in w["sides"] for t in [*s["trials"], *s["confirmations"]]]
    return [r["other_cores"] for r in runs if r.get("other_cores") is not None]


def render(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    lines = [f"`{doc['command']}`", "",
             f"commit `{env['commit']}`{' (daemon sources modified in the working tree)' if env['dirty'] else ''}; "
             f"{env['cores']} cores ({env['cpu']}), Python {env['python']}, Mosec {doc['mosec_version']}; "
             f"{doc['duration_s']:g} s per run (stretched to ~1,000 requests, at most 3x); {doc['wall_s']:.0f} s in all.",
             "", "| workload | model's limit (batch 32) | Mosec goodput (ratio to limit), mean batch | "
             "dynbatchd HTTP goodput (ratio to limit), mean batch | dynbatchd / Mosec | "
             "dynbatchd ZeroMQ (ratio), mean batch | other load (cores) min / median / max |",
             "|---|---|---|---|---|---|---|"]
    for w in doc["workloads"]:
        limit = w["limit_rps"]
        peer, http, zmq = best_peer(w), side_named(w, "http"), side_named(w, "zmq")
        ratio = (f"**{http['confirmed_rps'] / peer['confirmed_rps']:.2f}x**"
                 if peer and http and peer["confirmed_rps"] and http["confirmed_rps"] else "-")
        o = others(w)
        load = f"{min(o):.2f} / {float(np.median(o)):.2f} / {max(o):.2f}" if o else "-"
        lim = f"{limit:,.1f}" + (" (by construction)" if w["simulated"] else "")
        title = ("**SIMULATED** " if w["simulated"] else "") + w["title"]
        lines.append(f"| {title} | {lim} | {cell(peer, limit, True)} | {cell(http, limit)} | {ratio} | "
                     f"{cell(zmq, limit)} | {load} |")
    lines += ["", "Every side (confirmed = the highest passing rate passed again with another seed):", "",
              "| workload | side | confirmed req/s | best single pass | p50 / p99 ms there | errors there | "
              "mean batch | server cores | generator cores | runs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for w in doc["workloads"]:
        for s in w["sides"]:
            at = s["at_confirmed"]
            if at:
                r, c = at["result"], at["cpu"]
                there = (f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f}", f"{sum(r['errors'].values())} of {r['sent']}",
                         f"{c['mean_batch']:.1f}", f"{c['server_cores']:.2f}", f"{c['generator_cores']:.3f}")
            else:
                there = ("-",) * 5
            runs = sum(1 + ("discarded_noisy_run" in t["cpu"]) for t in [*s["trials"], *s["confirmations"]])
            lines.append(f"| {w['workload']} | {s['name']} | {s['confirmed_rps']:,.1f} | {s['best_single_rps']:,.1f} | "
                         + " | ".join(there) + f" | {runs} |")
    limits = doc.get("limits", {})
    if "minilm" in limits:
        m = limits["minilm"]
        lines += ["", f"MiniLM's limit: `benchmarks.peer_limit` (the runner alone, 1 torch thread, batches of 32), "
                      f"best of {len(m['rps'])}: {m['best']:,.1f} req/s (median {m['median']:,.1f}; "
                      f"repeats {', '.join(f'{x:,.1f}' for x in m['rps'])})."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help=f"comma-separated workloads (default all: {','.join(WORKLOADS)})")
    ap.add_argument("--duration", type=float, default=None, help="seconds per open-loop run (default 4, quick 2)")
    ap.add_argument("--quick", action="store_true", help="2 s runs, one bisection step")
    ap.add_argument("--headroom", type=float, default=None,
                    help="dynbatchd's slo window with its opt-in near-saturation rule (e.g. 0.85; default off)")
    ap.add_argument("--quiet-wait", type=float, default=3.0,
                    help="before each run, wait up to this many seconds for other load to stop (0: don't)")
    ap.add_argument("--no-zmq", action="store_true", help="leave out the dynbatchd-over-ZeroMQ side")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    command = "HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks.peer" + "".join(" " + shlex.quote(a) for a in argv)
    if importlib.util.find_spec("mosec") is None:
        print(f"{command}\nMosec is not installed (it is not a dependency of dynbatchd). To run this benchmark:\n"
              "    .venv/bin/pip install mosec")
        return 0
    wanted = [k.strip() for k in args.only.split(",") if k.strip()] or list(WORKLOADS)
    unknown = [k for k in wanted if k not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    args.duration = args.duration or (2.0 if args.quick else 4.0)
    global HEADROOM
    HEADROOM = args.headroom
    os.environ.update(ENV)
    from importlib.metadata import version
    env = environment()
    print(f"{command}\n{env['cores']} cores ({env['cpu']}), Python {env['python']}, commit {env['commit']}"
          f"{' (dirty)' if env['dirty'] else ''}, load average {env['loadavg_before'][0]:.2f}; "
          f"{args.duration:g} s per run", flush=True)
    t0 = time.monotonic()
    limits: dict[str, Any] = {}
    if any(WORKLOADS[k].model == "minilm" for k in wanted):
        limits["minilm"] = model_limit("minilm")
        print(f"MiniLM's limit (runner alone, batches of 32, 1 thread): {limits['minilm']}", flush=True)
    workloads = []
    for key in wanted:
        wl = WORKLOADS[key]
        limit = SIM_LIMIT if wl.model == "sim" else limits["minilm"]["best"]
        workloads.append(run_workload(wl, limit, args))
    doc = {"command": command, "environment": env, "mosec_version": version("mosec"), "duration_s": args.duration,
           "quick": args.quick, "quiet_wait_s": args.quiet_wait, "limits": limits, "workloads": workloads,
           "wall_s": round(time.monotonic() - t0, 1), "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print()
    print(render(doc))
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"peer-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(doc, indent=2, default=str))
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
