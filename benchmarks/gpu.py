"""The shipped model on a CUDA device, in one process: its offline curve, serial and pipelined.

    python -m benchmarks.gpu                                  # batch 1..256, float32 and float16
    python -m benchmarks.gpu --dtypes float32,bfloat16 --sizes 1,32,256
    python -m benchmarks.gpu --device cpu --sizes 1,8 --dtypes float32   # the same code on the CPU

The built-in sentence-embedding runner with the bundled all-MiniLM-L6-v2,
16-token sentences (14 words). For each dtype and batch size: the serial
batch time (`run`: tokenise, copy in, model, copy back, one batch after the
other, as today's worker), the device time of a batch (CUDA events, as the
pipeline reports it in compute_ns) and the pipelined rate
(`dynbatchd.devices.pipeline`: the next batch is tokenised and the last one
copied back while one runs). On a machine without CUDA it says so and exits 0.
Then the daemon on the same device and model (`--feeders 1,4`): answered/s,
p99 and device busy at fixed offered rates up to 4x that peak (`--multiples`),
for each number of feeders per device.
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import subprocess
import sys
import time

WORDS = "the a quick brown fox jumps over lazy dog while river runs past green hills under bright sky today".split()


def sentences(n: int, seed: int) -> list[str]:
    """`n` sentences of 14 words: 16 tokens each for MiniLM's tokenizer (with [CLS] and [SEP])."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(14)) for _ in range(n)]


def serial_ms(runner, texts: list[str], reps: int) -> float:
    """Median wall time of one `run`, a batch at a time (the device synchronised by the copy back)."""
    tokens = [16] * len(texts)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        runner.run(texts, tokens)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def pipelined(runner, batches: list[list[str]]) -> tuple[float, float]:
    """Batches per second through the pipeline, and the median device time of a batch (ms)."""
    from dynbatchd.devices.pipeline import Pipeline

    sent = []
    pipe = Pipeline(sent.append)
    start = time.perf_counter()
    for i, texts in enumerate(batches):
        pipe.submit(i, runner, "minilm", texts, [16] * len(texts))
    pipe.flush()
    rate = len(batches) / (time.perf_counter() - start)
    pipe.close()
    bad = [f.batch_id for f in sent if f.run.errors]
    if bad:
        raise SystemExit(f"batches {bad} had errors: {[sent[i].run.errors for i in bad][:1]}")
    return rate, statistics.median(f.compute_ns for f in sent) / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtypes", default="float32,float16")
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--reps", type=int, default=30, help="serial runs per point")
    ap.add_argument("--batches", type=int, default=60, help="pipelined batches per point")
    ap.add_argument("--feeders", default="1,4", help="daemon runs: workers_per_device values (empty: no daemon runs)")
    ap.add_argument("--multiples", default="0.5,1,2,4", help="daemon runs: offered rates as multiples of the peak")
    ap.add_argument("--seconds", type=float, default=5.0, help="daemon runs: seconds of load at each rate")
    ap.add_argument("--max-batch", type=int, default=128, help="daemon runs: the channel's max_batch")
    ap.add_argument("--slo-ms", type=float, default=50.0, help="daemon runs: the channel's deadline and the p99 SLO")
    args = ap.parse_args(argv)
    print("python -m benchmarks.gpu " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])))
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"no CUDA device here (torch {torch.__version__}): nothing measured. Run it on a GPU machine "
              "(see ../shared/gpu/README.md), or with --device cpu to try the code on the CPU.")
        return 0
    from dynbatchd.devices.embedding import SentenceEmbeddingRunner

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    where = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    print(f"commit {commit}; {args.device} = {where}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"all-MiniLM-L6-v2, 16 tokens a sentence; serial: median of {args.reps} runs; "
          f"pipelined: {args.batches} batches\n")
    print("| dtype | batch | serial ms | serial req/s | device ms | pipelined req/s | pipelined / serial |")
    print("|---|---|---|---|---|---|---|")
    sizes = [int(s) for s in args.sizes.split(",")]
    peak = 0.0
    for dtype in args.dtypes.split(","):
        runner = SentenceEmbeddingRunner(args.device, {"dtype": dtype})
        runner.load()
        for size in sizes:
            texts = sentences(size, size)
            for _ in range(3):
                runner.run(texts, [16] * size)   # warm this shape
            ms = serial_ms(runner, texts, args.reps)
            rate, device_ms = pipelined(runner, [sentences(size, size * 1000 + i) for i in range(args.batches)])
            print(f"| {dtype} | {size} | {ms:.2f} | {size * 1000 / ms:,.0f} | {device_ms:.2f} | {rate * size:,.0f} "
                  f"| {rate * size / (size * 1000 / ms):.2f}x |", flush=True)
            if dtype == args.dtypes.split(",")[0] and size <= args.max_batch:
                peak = max(peak, rate * size)
        del runner
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.feeders and peak:
        daemon_runs(args, peak)
    return 0


def daemon_runs(args: argparse.Namespace, peak: float) -> None:
    """The daemon on the same device and model: answered/s and p99 at fixed offered rates up to
    `multiples` x the offline peak (the first dtype, batches up to max_batch), for each number of
    feeders. Open-loop Poisson from one generator process: its send lag is printed (a late
    generator makes latency worse, never better)."""
    from benchmarks import loadgen
    from benchmarks.harness import RunningDaemon

    dtype = args.dtypes.split(",")[0]
    model = {"runner": "sentence-embedding", "options": {"dtype": dtype, "max_tokens": 64}}
    channel = {"max_batch": args.max_batch, "window_ms": args.slo_ms, "deadline_ms": args.slo_ms,
               "queue_limit": 65_536, "window": {"policy": "slo"}}
    texts = sentences(256, 7)
    print(f"\nThe daemon on {args.device}, {dtype}, max_batch {args.max_batch}, slo window, deadline = SLO "
          f"{args.slo_ms:g} ms; offline peak {peak:,.0f} req/s; {args.seconds:g} s a rate")
    print("| feeders | offered req/s | x peak | answered ok/s | / peak | p99 ms | errors | mean batch | "
          "send lag p99 ms | device busy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for feeders in (int(f) for f in args.feeders.split(",")):
        with RunningDaemon(f"gpu-{feeders}", {"minilm": model}, channel, workers_per_device=feeders,
                           use=(args.device,), cpu_threads=1 if args.device == "cpu" else 0) as d:
            loadgen.run(d.endpoint, "minilm", peak / 4, 2.0, inputs=texts, seed=99)   # warm every feeder
            for i, multiple in enumerate(float(m) for m in args.multiples.split(",")):
                before = d.status()["devices"][0].get("busy_s", 0.0)
                r = loadgen.run(d.endpoint, "minilm", multiple * peak, args.seconds, inputs=texts, seed=i,
                                drain_s=args.slo_ms / 1000 + 3.0)
                busy = (d.status()["devices"][0].get("busy_s", 0.0) - before) / r.elapsed_s
                print(f"| {feeders} | {multiple * peak:,.0f} | {multiple:g} | {r.achieved_rps:,.0f} | "
                      f"{r.achieved_rps / peak:.2f} | {r.p99_ms:.1f} | {r.error_count} | {r.mean_batch:.1f} | "
                      f"{r.send_lag_p99_ms:.1f} | {busy:.0%} |", flush=True)
        d.cleanup()


if __name__ == "__main__":
    sys.exit(main())
