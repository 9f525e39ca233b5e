"""Running one batch on a runner, so that one bad input never costs the others their answers.

Inputs the runner's `check` refuses are answered alone (bad_request); a batch
that fails is split in halves until the failing inputs are found, and an
out-of-memory is reported so the channel's sizer can shrink. The worker
process runs this on real runners; the simulator runs it on a
`VirtualRunner`, so both bisect exactly alike. A pipelined worker
(`dynbatchd.devices.pipeline`) runs a batch's stages itself and comes here
only when one raises, passing the failure so the whole batch is not run twice.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from dynbatchd.errors import DynbatchdError
from dynbatchd.logs import LineBudget

log = logging.getLogger("dynbatchd.worker")
failed_batch_lines = LineBudget()   # a line a failed batch, per model: a model failing every batch is a storm


class OutOfMemory(DynbatchdError):
    """The batch did not fit in device memory (runners raise it; the batch is then split)."""


class WorkerStopping(SystemExit):
    """The worker was told to stop (its SIGTERM handler raises it): the one BaseException that a
    model call lets through. Anything else a model raises, SystemExit and KeyboardInterrupt
    included, is the model failing its batch: it once escaped and ended the worker's device
    thread, so the worker held its batch until the watchdog killed it."""


MAX_DESCRIBED = 1000   # characters of an exception's text in a Failed message or log line


def describe(exc: BaseException) -> str:
    """`exc` as "TypeName: its text", the text only when str() works (cut to MAX_DESCRIBED): a
    model's exception whose __str__ raised once ended the worker while it was reporting it."""
    name = type(exc).__name__
    try:
        text = str(exc)
    except WorkerStopping:
        raise
    except BaseException:
        return f"{name} (its message could not be read)"
    return f"{name}: {text[:MAX_DESCRIBED]}" if text else name


class Undecodable:
    """An input the worker could not rebuild from its frames (`worker.decode_inputs`): refused alone."""

    def __init__(self, problem: str):
        self.problem = problem


def input_problem(runner: Any, item: Any) -> str | None:
    """Why `item` is refused before it runs (its runner's `check`, or that it could not be decoded)."""
    return item.problem if isinstance(item, Undecodable) else runner.check(item)


class Execution:
    """The outcome of one batch: per-item outputs or errors, and whether memory ran out."""

    def __init__(self, n: int):
        self.outputs: list[Any] = [None] * n
        self.errors: dict[int, str] = {}
        self.rejected: dict[int, str] = {}   # refused by the runner's check: the client's input is wrong
        self.oom = False
        self.batch: np.ndarray | list[Any] | None = None  # the whole batch's outputs, when it ran in one go


def completed(out: Any, n: int) -> Execution:
    """The outcome of a batch of `n` that ran whole and returned `out` (ValueError: not `n` outputs)."""
    result = Execution(n)
    result.batch = _as_batch(out, n)
    return result


def execute(runner: Any, inputs: list[Any], tokens: list[int], model: str,
            failed: BaseException | None = None) -> Execution:
    """Run a batch, isolating the inputs that fail. `failed`: the whole batch already failed with
    it (a pipeline stage raised), so go straight to its halves."""
    result = Execution(len(inputs))
    for i, item in enumerate(inputs):
        problem = input_problem(runner, item)
        if problem:
            result.errors[i] = result.rejected[i] = problem
    good = [i for i in range(len(inputs)) if i not in result.errors]
    if len(good) < len(inputs):
        _bisect(runner, inputs, tokens, good, result, model)
        return result
    try:
        if failed is not None:
            raise failed
        result.batch = _as_batch(runner.run(inputs, tokens), len(inputs))
    except WorkerStopping:
        raise
    except BaseException as exc:
        if (more := failed_batch_lines.admit(model)) is not None:
            (log.info if isinstance(exc, OutOfMemory) else log.warning)(
                "model %s failed a batch of %d (%s); isolating the failing inputs%s", model, len(inputs),
                type(exc).__name__, more)
        _split(runner, inputs, tokens, good, result, model, exc)   # it already failed whole: halves next
    return result


def _as_batch(out: Any, n: int) -> Any:
    if isinstance(out, np.ndarray):
        if out.shape[:1] != (n,):
            raise ValueError(f"runner returned shape {out.shape} for a batch of {n}")
        return np.ascontiguousarray(out)
    return list(out)


def _bisect(runner, inputs, tokens, idx: list[int], result: Execution, model: str) -> None:
    """Run `idx`; if that fails, split it (down to the inputs that fail alone)."""
    if not idx:
        return
    try:
        out = _as_batch(runner.run([inputs[i] for i in idx], [tokens[i] for i in idx]), len(idx))
    except WorkerStopping:
        raise
    except BaseException as exc:
        _split(runner, inputs, tokens, idx, result, model, exc)
        return
    for j, i in enumerate(idx):
        result.outputs[i] = out[j]


def _split(runner, inputs, tokens, idx: list[int], result: Execution, model: str, failure: BaseException) -> None:
    """`idx` failed together with `failure`: answer a single input, else try each half."""
    if isinstance(failure, OutOfMemory):
        result.oom = True
    if len(idx) == 1:
        # The exception type only: its text may quote the input, and payloads never reach logs.
        result.errors[idx[0]] = ("out of device memory for a single input" if isinstance(failure, OutOfMemory)
                                 else f"model {model} failed on this input ({type(failure).__name__})")
        return
    half = len(idx) // 2
    _bisect(runner, inputs, tokens, idx[:half], result, model)
    _bisect(runner, inputs, tokens, idx[half:], result, model)
