"""A worker's batches through a runner's three stages, overlapped, so the device never waits for Python.

The caller's thread (the worker's main loop, which alone touches the ZeroMQ
socket) decodes, `prepare`s, `finish`es and sends; one device thread runs
`forward`. While batch k is on the device, the caller finishes batch k-1 and
hands it to `send`, then prepares batch k+1. `submit` returns once the device
has taken its batch, so at most one batch is in each stage: memory stays
bounded and no batch waits behind more than one other. Results go to `send`
in the order the batches were submitted. A runner with no device stage to overlap (`INLINE`, as
``noop``) runs in the caller's thread instead: the hand-offs would be all it paid for.

A failure is isolated exactly as the serial worker isolates it: when a stage
raises for a batch (or one of its inputs is refused by `check`), that batch
alone goes through `execute`, on the device, which splits it in halves to
find the failing inputs and reports an out-of-memory. `compute_ns` is the
device stage's time (the runner's own device timing when it has one: on CUDA
`forward` returns before the device is done), which is what the daemon's cost
model must learn; the CPU stages' times travel beside it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from dynbatchd.devices.execution import Execution, WorkerStopping, completed, execute, input_problem

log = logging.getLogger("dynbatchd.worker")


@dataclass(slots=True)
class Finished:
    """One batch's outcome, handed to `send`."""
    batch_id: int
    run: Execution
    compute_ns: int    # the device stage (and any re-run of a failed batch)
    prepare_ns: int    # the CPU before it (check and prepare)
    finish_ns: int     # the CPU after it (waiting for the outputs, making them numpy or a list)
    simulated: bool


class _Batch:
    __slots__ = ("batch_id", "runner", "model", "inputs", "tokens", "prepared", "output", "fallback",
                 "failure", "run", "compute_ns", "prepare_ns")

    def __init__(self, batch_id: int, runner: Any, model: str, inputs: list[Any], tokens: list[int]):
        self.batch_id, self.runner, self.model, self.inputs, self.tokens = batch_id, runner, model, inputs, tokens
        self.prepared: Any = None
        self.output: Any = None
        self.fallback = False                    # run it through `execute` instead of the stages
        self.failure: BaseException | None = None    # what made it fall back (None: a refused input)
        self.run: Execution | None = None
        self.compute_ns = self.prepare_ns = 0


class Pipeline:
    """Overlapped batches for one worker. Not for several caller threads: `submit`, `collect`,
    `flush` and `close` belong to the one thread that also owns the socket `send` writes to."""

    def __init__(self, send: Callable[[Finished], None]):
        self._send = send
        self._cond = threading.Condition()
        self._slot: _Batch | None = None       # prepared, waiting for the device to take it
        self._on_device: _Batch | None = None
        self._done: deque[_Batch] = deque()    # off the device, waiting to be finished and sent
        self._device = threading.Lock()        # held while the device works (a re-run in `_finish` waits)
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()  # readable when a batch left the device: poll it beside the socket
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._device_loop, name="dynbatchd-device", daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        """Readable when a batch has left the device: then call `collect`. (Register this number with
        zmq.Poller, which answers with the number, not with this object.)"""
        return self._wake_r

    def submit(self, batch_id: int, runner: Any, model: str, inputs: list[Any], tokens: list[int]) -> None:
        """Prepare a batch here (while the device runs the one before), hand it to the device, and
        finish and send the batches that leave the device meanwhile. Returns once the device has it."""
        batch = _Batch(batch_id, runner, model, inputs, tokens)
        start = time.perf_counter_ns()
        try:
            if any(input_problem(runner, item) for item in inputs):
                batch.fallback = True    # `execute` answers the refused ones alone
            else:
                prepare = getattr(runner, "prepare", None)
                batch.prepared = prepare(inputs, tokens) if prepare else (inputs, tokens)
        except WorkerStopping:
            raise
        except BaseException as exc:   # (SystemExit from a model too: `execution.WorkerStopping`)
            batch.fallback, batch.failure = True, exc
        batch.prepare_ns = time.perf_counter_ns() - start
        if getattr(runner, "INLINE", False):   # no device stage to overlap (noop): no thread hand-offs
            self.flush()                       # (results keep the order of submission)
            with self._device:
                self._forward(batch)
            self._finish(batch)
            return
        with self._cond:
            if self._closed:
                raise RuntimeError("the pipeline is closed")
            self._slot = batch
            self._cond.notify_all()
        self._finish_until(lambda: self._slot is not batch)

    def collect(self) -> None:
        """Finish and send the batches that have left the device; never waits for the device."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        self._finish_until(lambda: True)

    def flush(self) -> None:
        """Wait for every submitted batch, finishing and sending each."""
        self._finish_until(lambda: self._slot is None and self._on_device is None)

    def close(self) -> None:
        """Send what is in flight, then stop the device thread."""
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _finish_until(self, until: Callable[[], bool]) -> None:
        """Finish and send batches as they leave the device, until `until()` holds and none is left."""
        while True:
            with self._cond:
                while not self._done and not until():
                    self._cond.wait()
                if not self._done:
                    return
                batch = self._done.popleft()
            self._finish(batch)

    def _device_loop(self) -> None:
        while True:
            with self._cond:
                while self._slot is None and not self._closed:
                    self._cond.wait()
                if self._slot is None:
                    return
                batch, self._slot = self._slot, None
                self._on_device = batch
                self._cond.notify_all()
            with self._device:
                self._forward(batch)
            with self._cond:
                self._done.append(batch)
                self._on_device = None
                self._cond.notify_all()
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass    # full: the reader has wake-ups enough

    def _forward(self, batch: _Batch) -> None:
        """The device stage; a batch whose stage failed is re-run here, split, by `execute`."""
        start = time.perf_counter_ns()
        try:
            if not batch.fallback:
                try:
                    forward = getattr(batch.runner, "forward", None)
                    batch.output = forward(batch.prepared) if forward else batch.runner.run(*batch.prepared)
                except WorkerStopping:
                    raise
                except BaseException as exc:
                    batch.fallback, batch.failure = True, exc
            batch.prepared = None
            if batch.fallback:
                batch.run = execute(batch.runner, batch.inputs, batch.tokens, batch.model, failed=batch.failure)
        except WorkerStopping:
            raise
        except BaseException as exc:   # (execute itself failed, say a `check` that raises: never stall the caller)
            log.error("model %s: a batch of %d failed outside the model (%s)", batch.model, len(batch.inputs),
                      type(exc).__name__)
            batch.run = Execution(len(batch.inputs))
            batch.run.errors = {i: f"model {batch.model} failed ({type(exc).__name__})"
                                for i in range(len(batch.inputs))}
        batch.compute_ns = time.perf_counter_ns() - start

    def _finish(self, batch: _Batch) -> None:
        start = time.perf_counter_ns()
        runner = batch.runner
        if batch.run is None:
            try:
                finish = getattr(runner, "finish", None)
                batch.run = completed(finish(batch.output) if finish else batch.output, len(batch.inputs))
                timed = getattr(runner, "device_ns", None)
                device_ns = timed(batch.output) if timed else None
                if device_ns is not None:
                    batch.compute_ns = device_ns
            except WorkerStopping:
                raise
            except BaseException as exc:
                with self._device:   # the re-run has the device to itself, as `forward` does
                    rerun = time.perf_counter_ns()
                    batch.run = execute(runner, batch.inputs, batch.tokens, batch.model, failed=exc)
                    batch.compute_ns += time.perf_counter_ns() - rerun
        batch.output = None
        self._send(Finished(batch.batch_id, batch.run, batch.compute_ns, batch.prepare_ns,
                            time.perf_counter_ns() - start, bool(getattr(runner, "simulated", False))))
