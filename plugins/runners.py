"""Model runners shipped with dynbatchd: sentence-embedding, torchscript, exported, callable, simulated, noop."""

from __future__ import annotations

from dynbatchd.hookspecs import hookimpl


@hookimpl
def dynbatchd_runners():
    # Imported lazily by the runner itself: torch loads only in worker processes. Each class
    # declares its OPTIONS, so the daemon checks a model's options without importing torch.
    from dynbatchd.devices import embedding, exported, runners, simulated_runner
    return {
        "sentence-embedding": embedding.SentenceEmbeddingRunner,
        "torchscript": exported.TorchScriptRunner,
        "exported": exported.ExportedRunner,
        "callable": runners.CallableRunner,
        "simulated": simulated_runner.SimulatedRunner,
        "noop": runners.NoopRunner,
        "causal-lm": __import__("dynbatchd.devices.causal_lm", fromlist=["_"]).CausalLMRunner,   # no torch at import
    }
