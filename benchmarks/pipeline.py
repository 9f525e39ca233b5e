"""The pipelined worker against the serial one, in process, on a SIMULATED device (CPU only).

    python -m benchmarks.pipeline                          # batch 32, device 8 ms, CPU 0.125 and 0.25 ms/item
    python -m benchmarks.pipeline --cpu-ms-per-item 0.25 --device-ms 8 --batches 100
    python -m benchmarks.pipeline --live                   # also through a live daemon, 1 and 2 feeders
    python -m benchmarks.pipeline --live --setups 1:2,1:3  # feeders:inflight pairs, side by side

The simulated runner burns `cpu_ms_per_item` of real CPU per item in `prepare`
(standing in for tokenising) and sleeps `device-ms` in `forward` (standing in
for the device). Serial is today's worker: `execute` runs the stages in a row,
so a batch takes their sum. Pipelined is `dynbatchd.devices.pipeline`: while
one batch sleeps on the device the next burns its CPU, so it should approach
1/max(stage). Each batch's result is encoded as the worker would send it.
Printed: batches/s of each, and each as a share of 1/max(stages) and
1/sum(stages), from the nominal stage times; beside them the stage times the
pipeline measured (on a busy machine the CPU stage stretches).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time

from dynbatchd.devices.execution import execute
from dynbatchd.devices.pipeline import Finished, Pipeline
from dynbatchd.devices.simulated_runner import SimulatedRunner
from dynbatchd.devices.worker import encode_result


def serial(runner: SimulatedRunner, batches: int, inputs: list[str], tokens: list[int]) -> float:
    """Batches per second of the worker as it is: one batch at a time, stages in a row."""
    start = time.perf_counter()
    for i in range(batches):
        began = time.perf_counter_ns()
        run = execute(runner, inputs, tokens, "sim")
        encode_result(i, run, time.perf_counter_ns() - began, True)
    return batches / (time.perf_counter() - start)


def pipelined(runner: SimulatedRunner, batches: int, inputs: list[str],
              tokens: list[int]) -> tuple[float, list[Finished]]:
    sent: list[Finished] = []

    def send(done: Finished) -> None:
        encode_result(done.batch_id, done.run, done.compute_ns, done.simulated)
        sent.append(done)

    pipe = Pipeline(send)
    start = time.perf_counter()
    for i in range(batches):
        pipe.submit(i, runner, "sim", inputs, tokens)
    pipe.flush()
    rate = batches / (time.perf_counter() - start)
    pipe.close()
    return rate, sent


def mean_ms(values: list[int]) -> float:
    return sum(values) / len(values) / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.pipeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-ms-per-item", default="0.125,0.25", help="CPU per item in prepare, comma-separated")
    ap.add_argument("--device-ms", type=float, default=8.0, help="the simulated device's time per batch")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=80, help="batches per run")
    ap.add_argument("--live", action="store_true",
                    help="also through a live daemon (1 and 2 feeders): answered/s when offered 1.5x 1/max(stage)")
    ap.add_argument("--seconds", type=float, default=4.0, help="--live: seconds of load per run")
    ap.add_argument("--setups", default="1:2,1:3,2:2",
                    help="--live: feeders:inflight pairs ([devices] workers_per_device and inflight), comma-separated")
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    given = argv if argv is not None else sys.argv[1:]
    print("python -m benchmarks.pipeline " + " ".join(shlex.quote(a) for a in given))
    print(f"commit {commit}; SIMULATED device {args.device_ms:g} ms a batch (a sleep); batch {args.batch}; "
          f"{args.batches} batches a run; {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f} before\n")
    print("| CPU ms/item | CPU stage ms | device ms | serial batches/s | pipelined batches/s | speed-up "
          "| pipelined / (1/max) | serial / (1/sum) | measured prepare / device / finish ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    inputs, tokens = [f"sentence {i}" for i in range(args.batch)], [16] * args.batch
    for cpu_ms in (float(x) for x in args.cpu_ms_per_item.split(",")):
        runner = SimulatedRunner("cpu", {"base_ms": args.device_ms, "per_item_ms": 0.0, "cpu_ms_per_item": cpu_ms})
        cpu_stage = cpu_ms * args.batch
        ceiling, floor = 1000 / max(cpu_stage, args.device_ms), 1000 / (cpu_stage + args.device_ms)
        serial(runner, 3, inputs, tokens)   # warm
        one = serial(runner, args.batches, inputs, tokens)
        many, sent = pipelined(runner, args.batches, inputs, tokens)
        measured = " / ".join(f"{mean_ms([getattr(f, k) for f in sent]):.2f}"
                              for k in ("prepare_ns", "compute_ns", "finish_ns"))
        print(f"| {cpu_ms:g} | {cpu_stage:g} | {args.device_ms:g} | {one:.1f} | {many:.1f} | {many / one:.2f}x "
              f"| {many / ceiling:.2f} | {one / floor:.2f} | {measured} |")
    print(f"\nload {os.getloadavg()[0]:.2f} after (on a shared machine, a high load stretches the CPU stage)")
    if args.live:
        live(args)
    return 0


def live(args: argparse.Namespace) -> None:
    """The same stand-in through a real daemon: the engine sends a feeder its next batch its
    measured CPU stage before the device frees (`cpu_stage_ms`), so one pipelined feeder should
    near 1/max(stage); a second feeder overlaps the CPU work of two batches."""
    from benchmarks import loadgen
    from benchmarks.harness import RunningDaemon

    print("\nLive daemon, same SIMULATED stand-in, open loop at 1.5x 32/max(stage) requests/s, "
          f"{args.seconds:g} s a run")
    print("| CPU ms/item | feeders | inflight | offered req/s | answered ok/s | / (batch / max stage) "
          "| / (batch / sum) | mean batch | cpu_stage_ms learned |")
    print("|---|---|---|---|---|---|---|---|---|")
    setups = [tuple(int(n) for n in pair.split(":")) for pair in args.setups.split(",")]
    for cpu_ms in (float(x) for x in args.cpu_ms_per_item.split(",")):
        cpu_stage = cpu_ms * args.batch
        ceiling = args.batch * 1000 / max(cpu_stage, args.device_ms)
        floor = args.batch * 1000 / (cpu_stage + args.device_ms)
        model = {"runner": "simulated",
                 "options": {"base_ms": args.device_ms, "per_item_ms": 0.0, "cpu_ms_per_item": cpu_ms}}
        channel = {"max_batch": args.batch, "window_ms": 5.0, "deadline_ms": 60_000.0, "queue_limit": 100_000}
        for feeders, inflight in setups:
            with RunningDaemon(f"pipeline-{feeders}-{inflight}", {"sim": model}, channel, inflight=inflight,
                               workers_per_device=feeders) as d:
                loadgen.run(d.endpoint, "sim", ceiling / 2, 1.0, seed=1)   # warm: the cost and the CPU stage
                r = loadgen.run(d.endpoint, "sim", 1.5 * ceiling, args.seconds, drain_s=10.0, seed=2)
                stage = d.status()["devices"][0].get("cpu_stage_ms")
            d.cleanup()
            print(f"| {cpu_ms:g} | {feeders} | {inflight} | {1.5 * ceiling:.0f} | {r.achieved_rps:.0f} | "
                  f"{r.achieved_rps / ceiling:.2f} | {r.achieved_rps / floor:.2f} | {r.mean_batch:.1f} | {stage} |",
                  flush=True)


if __name__ == "__main__":
    sys.exit(main())
