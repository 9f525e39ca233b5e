"""Model runners shipped with dynbatchd: sentence-embedding, callable, simulated, noop."""

from __future__ import annotations

from dynbatchd.hookspecs import hookimpl


@hookimpl
def dynbatchd_runners():
    # Imported lazily by the runner itself: torch loads only in worker processes. Each class
    # declares its OPTIONS, so the daemon checks a model's options without importing torch.
    from dynbatchd.devices import runners
    return {
        "sentence-embedding": runners.SentenceEmbeddingRunner,
        "callable": runners.CallableRunner,
        "simulated": runners.SimulatedRunner,
        "noop": runners.NoopRunner,
    }
