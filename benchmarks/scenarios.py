"""The benchmark scenarios of `make bench`, as data: daemon config, load and SLO for each.

Each batched scenario has a max_batch=1 twin run in the same command, so the gain from
batching is read as a ratio on the same machine at the same moment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SIM_BASE_MS, SIM_PER_ITEM_MS, SIM_BATCH = 8.0, 0.5, 32
SIM_LIMIT = SIM_BATCH / ((SIM_BASE_MS + SIM_PER_ITEM_MS * SIM_BATCH) / 1000)   # 1,333 req/s
SIM1_LIMIT = 1 / ((SIM_BASE_MS + SIM_PER_ITEM_MS) / 1000)                      # 117.6 req/s

SIMULATED = {"runner": "simulated", "options": {"base_ms": SIM_BASE_MS, "per_item_ms": SIM_PER_ITEM_MS}}
MINILM = {"runner": "sentence-embedding", "options": {"max_tokens": 64}}
# The same model with its weights in bfloat16 (the runner's dtype option): on a CPU with AVX512-BF16 a
# forward reads half the bytes; its embeddings stay within a cosine of 0.9999 of float32's (issue 30).
MINILM_BF16 = {"runner": "sentence-embedding", "options": {"max_tokens": 64, "dtype": "bfloat16"}}
NOOP = {"runner": "noop"}

# Short support-desk style sentences (5-12 words), sent round-robin.
TEXTS = [
    "how do I reset my password",
    "my order has not arrived yet",
    "can I change the delivery address after checkout",
    "the app crashes when I open the camera",
    "please cancel my subscription at the end of the month",
    "is there a student discount",
    "what are your opening hours on Sunday",
    "I was charged twice for the same order",
    "the quick brown fox jumps over the lazy dog",
    "where can I download last year's invoices",
    "does this laptop support two external monitors",
    "refund the damaged item and keep the rest",
    "how long does shipping to Norway take",
    "the password reset email never came",
    "upgrade my plan to the team edition",
    "can support call me back tomorrow morning",
]


@dataclass
class Scenario:
    name: str
    title: str
    model: str
    models: dict[str, dict[str, Any]]
    channel: dict[str, Any]
    slo_ms: float
    start: float                  # first offered rate of the goodput search
    factor: float = 1.25          # probe step
    probes: int = 4
    refine: int = 2
    ceiling: float | None = None  # never offer more than this
    limit: float | None = None    # the device's theoretical limit, req/s (simulated only)
    inputs: list[Any] = field(default_factory=lambda: ["hello world"])
    cpu_threads: int = 0
    twin_of: str | None = None    # the batched scenario this max_batch=1 run sits beside
    fixed_rates: list[float] = field(default_factory=list)   # extra runs at set rates (CPU per request)


def channel(max_batch: int, window_ms: float, deadline_ms: float = 1000.0, queue_limit: int = 8192) -> dict[str, Any]:
    return {"max_batch": max_batch, "window_ms": window_ms, "deadline_ms": deadline_ms, "queue_limit": queue_limit}


def slo_channel(max_batch: int, deadline_ms: float, headroom: float | None = None) -> dict[str, Any]:
    """The documented throughput settings: the `slo` window, the channel's deadline (and window bound) = the SLO.
    `headroom` > 0 turns on its opt-in near-saturation rule (fuller batches; off by default since issue 30)."""
    options = {} if headroom is None else {"headroom": headroom}
    return {**channel(max_batch, deadline_ms, deadline_ms=deadline_ms),
            "window": {"policy": "slo", "options": options}}


def all_scenarios() -> list[Scenario]:
    return [
        Scenario("sim-b32", f"SIMULATED accelerator ({SIM_BASE_MS:g} ms + {SIM_PER_ITEM_MS:g} ms/item), max_batch=32",
                 "sim", {"sim": SIMULATED}, channel(SIM_BATCH, 30.0), slo_ms=100.0,
                 start=0.9 * SIM_LIMIT, factor=1.05, probes=3, refine=2, ceiling=1.1 * SIM_LIMIT, limit=SIM_LIMIT),
        Scenario("sim-b32-w10", "SIMULATED accelerator, max_batch=32, 10 ms window (the peers' knobs)",
                 "sim", {"sim": SIMULATED}, channel(SIM_BATCH, 10.0), slo_ms=100.0,
                 start=0.9 * SIM_LIMIT, factor=1.05, probes=3, refine=2, ceiling=1.1 * SIM_LIMIT, limit=SIM_LIMIT),
        Scenario("sim-b1", "SIMULATED accelerator, max_batch=1", "sim", {"sim": SIMULATED}, channel(1, 0.0),
                 slo_ms=100.0, start=0.8 * SIM1_LIMIT, factor=1.1, probes=3, refine=2, ceiling=1.1 * SIM1_LIMIT,
                 limit=SIM1_LIMIT, twin_of="sim-b32"),
        Scenario("minilm-b32", "MiniLM-L6 on CPU, max_batch=32", "minilm", {"minilm": MINILM},
                 channel(32, 20.0, deadline_ms=2000.0), slo_ms=500.0, start=150.0, factor=1.4, probes=4,
                 refine=2, inputs=TEXTS, cpu_threads=1),
        Scenario("minilm-b1", "MiniLM-L6 on CPU, max_batch=1", "minilm", {"minilm": MINILM},
                 channel(1, 0.0, deadline_ms=2000.0), slo_ms=500.0, start=40.0, factor=1.4, probes=4,
                 refine=2, inputs=TEXTS, cpu_threads=1, twin_of="minilm-b32"),
        Scenario("sim-b32-slo", "SIMULATED accelerator, max_batch=32, slo window, deadline = SLO 100 ms",
                 "sim", {"sim": SIMULATED}, slo_channel(SIM_BATCH, 100.0), slo_ms=100.0,
                 start=0.85 * SIM_LIMIT, factor=1.04, probes=4, refine=2, ceiling=1.05 * SIM_LIMIT, limit=SIM_LIMIT),
        Scenario("sim-b32-slo-gather", "same, slo's opt-in near-saturation rule on (headroom = 0.85)",
                 "sim", {"sim": SIMULATED}, slo_channel(SIM_BATCH, 100.0, headroom=0.85), slo_ms=100.0,
                 start=0.85 * SIM_LIMIT, factor=1.04, probes=4, refine=2, ceiling=1.05 * SIM_LIMIT, limit=SIM_LIMIT),
        Scenario("minilm-b32-slo", "MiniLM-L6 on CPU, 1 thread, max_batch=32, slo window, deadline = SLO 250 ms",
                 "minilm", {"minilm": MINILM}, slo_channel(32, 250.0), slo_ms=250.0, start=240.0, factor=1.08,
                 probes=4, refine=2, inputs=TEXTS, cpu_threads=1),
        Scenario("minilm-b32-slo-gather", "same, slo's opt-in near-saturation rule on (headroom = 0.85)",
                 "minilm", {"minilm": MINILM}, slo_channel(32, 250.0, headroom=0.85), slo_ms=250.0, start=240.0,
                 factor=1.08, probes=4, refine=2, inputs=TEXTS, cpu_threads=1),
        Scenario("minilm-b32-slo50", "MiniLM-L6 on CPU, 1 thread, max_batch=32, slo window, deadline = SLO 50 ms",
                 "minilm", {"minilm": MINILM}, slo_channel(32, 50.0), slo_ms=50.0, start=130.0, factor=1.1,
                 probes=4, refine=2, inputs=TEXTS, cpu_threads=1),
        Scenario("minilm-b32-slo50-bf16", "same, the model in bfloat16 (dtype option; not the issue's bar, "
                 "which is float32)", "minilm", {"minilm": MINILM_BF16}, slo_channel(32, 50.0), slo_ms=50.0,
                 start=150.0, factor=1.15, probes=4, refine=2, inputs=TEXTS, cpu_threads=1),
        Scenario("noop-b64", "no-op model, max_batch=64 (the daemon's own cost)", "noop", {"noop": NOOP},
                 channel(64, 0.0, queue_limit=65536), slo_ms=50.0, start=12000.0, factor=1.3, probes=5,
                 refine=2, fixed_rates=[1000.0, 5000.0]),
        Scenario("noop-b1", "no-op model, max_batch=1", "noop", {"noop": NOOP}, channel(1, 0.0, queue_limit=65536),
                 slo_ms=50.0, start=1500.0, factor=1.5, probes=6, refine=2, twin_of="noop-b64",
                 fixed_rates=[1000.0]),
    ]


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.scenarios sales-peak | k12`: the guide's peak cases (benchmarks/peak.py)."""
    import argparse
    import shlex
    import sys

    from benchmarks import peak

    ap = argparse.ArgumentParser(prog="python -m benchmarks.scenarios", description=peak.__doc__.split("\n\n")[0])
    ap.add_argument("scenario", choices=["sales-peak", "k12"])
    ap.add_argument("--seconds", type=float, default=None,
                    help="sales-peak: simulated seconds (default 60); k12: simulated seconds per guide hour (60)")
    args = ap.parse_args(argv)
    print("python -m benchmarks.scenarios " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    if args.scenario == "sales-peak":
        peak.print_sales_peak(args.seconds or 60.0)
    else:
        peak.print_k12(args.seconds or 60.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
