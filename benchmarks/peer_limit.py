"""The model's limit: dynbatchd's runner alone, in one process, batches of 32, requests/s.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python -m benchmarks.peer_limit minilm --seconds 1.5 --repeats 5

No server, no queue, no serialisation: `runner.run` on batches of `--batch` texts
(scenarios.TEXTS, round robin) back to back, after three warm-up batches. Prints one JSON
line: requests/s of each repeat (each about `--seconds` long), the best and the median.
`benchmarks.peer` runs it in a child process with the thread settings of the servers'
workers (OMP_NUM_THREADS / MKL_NUM_THREADS set before torch is imported).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from typing import Any

from benchmarks.scenarios import MINILM, SIMULATED, TEXTS

MODELS = {"minilm": MINILM, "sim": SIMULATED}


def build_runner(model: str) -> Any:
    """dynbatchd's own runner for `model` (as its worker builds it from the scenario's config), loaded."""
    from dynbatchd.devices.runners import SentenceEmbeddingRunner, SimulatedRunner

    spec = MODELS[model]
    cls = SentenceEmbeddingRunner if spec["runner"] == "sentence-embedding" else SimulatedRunner
    runner = cls("cpu", dict(spec.get("options", {})))
    runner.load()
    return runner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peer_limit", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    runner = build_runner(args.model)
    batches = [[TEXTS[(b * args.batch + i) % len(TEXTS)] for i in range(args.batch)] for b in range(len(TEXTS))]
    tokens = [[len(t) // 4 + 1 for t in batch] for batch in batches]
    for k in range(3):
        runner.run(batches[k], tokens[k])
    rates = []
    for _ in range(args.repeats):
        done, k, t0 = 0, 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            runner.run(batches[k % len(batches)], tokens[k % len(batches)])
            done += args.batch
            k += 1
        rates.append(done / (time.perf_counter() - t0))
    threads = None
    try:
        import torch
        threads = torch.get_num_threads()
    except ImportError:
        pass
    print(json.dumps({"model": args.model, "batch": args.batch, "rps": [round(r, 1) for r in rates],
                      "best": round(max(rates), 1), "median": round(statistics.median(rates), 1),
                      "torch_threads": threads}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
