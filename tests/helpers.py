"""Helpers for the end-to-end tests, and a user's model for the `callable` runner.

echo_or_fail returns each input back, except that the input "fail" raises
(the worker must isolate it), "crash" (or any text starting so) kills the worker process outright and
"hang" never returns. The daemon's workers import this module for it, so everything at module
level stays standard library; the test helpers import what they need when called.

wait_until(predicate, timeout_s, interval_s=0.05, message=...): poll with a pause between checks
(benchmarks/harness.py has the one implementation). outcomes(futures) / codes(futures): what
each client future came to.
"""

import os
import time


def echo_or_fail(inputs):
    texts = [x for x in inputs if isinstance(x, str)]
    if any(t.startswith("crash") for t in texts):
        os._exit(3)
    if "hang" in texts:
        time.sleep(3600)
    if "fail" in texts:
        raise ValueError("this input is poison")
    return [x for x in inputs]


def oom_above_four(inputs):
    """Each text's length; a batch of more than four runs out of memory (a device whose limit the
    daemon does not know in advance, unlike the simulated runner's memory_items)."""
    if len(inputs) > 4:
        from dynbatchd.devices.execution import OutOfMemory

        raise OutOfMemory(f"{len(inputs)} inputs do not fit")
    return [float(len(x)) for x in inputs]


def wait_until(predicate, timeout_s, interval_s=0.05, *, message="condition not met"):
    """Call `predicate` until it returns something truthy (and return that), sleeping `interval_s`
    between calls; fail (WaitTimeout, an AssertionError) with `message` after `timeout_s`."""
    from launcher import wait_until as wait

    return wait(predicate, timeout_s, interval_s, message=message)


class Failure(str):
    """A future that failed: equal to its error code (``"model_error"``), its text in `.message`."""

    message: str = ""

    def __new__(cls, code, message=""):
        self = super().__new__(cls, code)
        self.message = message
        return self

    def __repr__(self):
        return f"Failure({str(self)!r}, {self.message!r})"


def outcomes(futures, timeout=60):
    """Each client future's result output, or a Failure (its error code) where it raised a
    DynbatchdError; in the futures' order. Other exceptions propagate."""
    from dynbatchd.client import DynbatchdError

    out = []
    for future in futures:
        try:
            out.append(future.result(timeout=timeout).output)
        except DynbatchdError as exc:
            out.append(Failure(exc.code, str(exc)))
    return out


def codes(futures, timeout=60):
    """"ok" for each future that succeeded, else its error code."""
    return [o if isinstance(o, Failure) else "ok" for o in outcomes(futures, timeout)]


def embed(inputs):
    """A stand-in encoder for the HTTP tests: each text becomes [its length, its word count, 1]."""
    import numpy as np

    return np.array([[len(t), len(t.split()), 1.0] for t in inputs], dtype=np.float32)


def nan_rows(inputs):
    """A model whose outputs are not finite: each input becomes [NaN, inf] (the HTTP door answers 502)."""
    import numpy as np

    return np.array([[float("nan"), float("inf")] for _ in inputs], dtype=np.float32)


def echo_or_hang(inputs):
    """Each input back, except that a batch holding a text starting "hang" never returns (so each
    test can hang on an input of its own, "hang1", "hang2", none quarantined by another)."""
    if any(isinstance(x, str) and x.startswith("hang") for x in inputs):
        time.sleep(3600)
    return list(inputs)


# The least a config needs (one simulated model, one channel), for the config tests to add to.
MINIMAL_CONFIG = """
[models.m]
runner = "simulated"
[channels.standard]
max_batch = 8
window_ms = 5
"""
