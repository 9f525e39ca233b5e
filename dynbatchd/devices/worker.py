"""The worker process: one per device, started and supervised by the daemon.

It connects a DEALER socket to the daemon's ipc:// endpoint, says hello,
receives its setup (device and models), loads and warms every model, says
ready, then runs its batches through a `Pipeline`: while one batch is on the
device, this thread decodes and prepares the next and finishes and sends the
last, so the device does not wait for Python. (Several such workers may feed
one device: [devices] workers_per_device.) Arrays travel as raw frames; a
batch that fails is split in halves until the failing inputs are found, so
one bad input (or one out-of-memory) never costs the others their answers.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from typing import Any

import numpy as np
import zmq

from dynbatchd import protocol as P
from dynbatchd.devices.execution import Execution, Undecodable, WorkerStopping, describe, execute  # noqa: F401 (execute: imported from here by tests)
from dynbatchd.devices.pipeline import Finished, Pipeline
from dynbatchd.devices.runners import Runner
from dynbatchd.memory import batch_peak_bytes
from dynbatchd.logs import FORMATS, LineBudget, setup as setup_logging, withhold_stderr

log = logging.getLogger("dynbatchd.worker")
failed_step_lines = LineBudget()   # a line a failed generation step, per model: one failing every step is a storm


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when the daemon goes away."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _combine(run: Execution) -> np.ndarray | list[Any]:
    """The batch's outputs as one array when they stack, else as a list of values."""
    if run.batch is not None:
        return run.batch
    arrays = [o for i, o in enumerate(run.outputs) if i not in run.errors]
    if arrays and all(isinstance(a, np.ndarray) for a in arrays) and \
            len({(a.shape, a.dtype) for a in arrays}) == 1:
        stacked = np.zeros((len(run.outputs),) + arrays[0].shape, dtype=arrays[0].dtype)
        for i, o in enumerate(run.outputs):
            if i not in run.errors:
                stacked[i] = o
        return stacked
    return [o.tolist() if isinstance(o, np.ndarray) else o for o in run.outputs]


def encode_result(batch_id: int, run: Execution, compute_ns: int, simulated: bool,
                  prepare_ns: int = 0, memory_bytes: int = 0) -> list[Any]:
    """BatchResult header plus frames: a stacked array travels as one raw frame, uncopied.
    `memory_bytes`: torch's peak allocated during the batch (`dynbatchd.memory.batch_peak_bytes`)."""
    out = _combine(run)
    if isinstance(out, np.ndarray):
        out, problem = wire_array(out)
        if problem is not None:
            return [refused_array(batch_id, compute_ns, run, simulated, problem)]
        header = P.BatchResult(batch_id, compute_ns, P.TensorRef(str(out.dtype), list(out.shape), 0),
                               None, run.errors, run.oom, simulated, run.rejected, prepare_ns, memory_bytes)
        try:
            return [P.encoder.encode(header), memoryview(out).cast("B")]
        except Exception as exc:   # a buffer memoryview cannot cast: never end the worker over it
            return [refused_array(batch_id, compute_ns, run, simulated, _reason(exc))]
    try:
        return [P.encoder.encode(P.BatchResult(batch_id, compute_ns, None, out, run.errors, run.oom, simulated,
                                               run.rejected, prepare_ns, memory_bytes))]
    except Exception as exc:   # a lone surrogate, nesting too deep, an object: once ended the worker
        return [unsendable(batch_id, compute_ns, run, simulated, out, exc)]


def wire_array(out: np.ndarray) -> tuple[np.ndarray, str | None]:
    """`out` as the wire carries it, in native byte order (the daemon refused a big-endian `>f4`
    as an unsupported dtype, failing the whole batch), or why it cannot go: a dtype the protocol
    does not carry (`protocol.DTYPES`). An object array's buffer is pointers, which once went out."""
    native = out.dtype if out.dtype.isnative else out.dtype.newbyteorder("=")
    if native.fields is not None or native.name not in P.DTYPES:
        return out, f"dtype {str(out.dtype)[:80]} is not one the wire carries ({', '.join(P.DTYPES)})"
    return (out if native is out.dtype else out.astype(native)), None


def refused_array(batch_id: int, compute_ns: int, run: Execution, simulated: bool, problem: str) -> bytes:
    """The result of a batch whose stacked output array cannot go out (`wire_array`): each of its
    outputs is answered model_error saying why; inputs that had failed keep their own error."""
    errors = {i: run.errors.get(i, f"model output could not be encoded ({problem})") for i in range(len(run.outputs))}
    return P.encoder.encode(P.BatchResult(batch_id, compute_ns, None, None, errors, run.oom, simulated, run.rejected))


def unsendable(batch_id: int, compute_ns: int, run: Execution, simulated: bool, out: list[Any],
               exc: Exception) -> bytes:
    """The result of a batch whose outputs `out` (`_combine`'s values) cannot all be encoded: those
    that cannot alone are answered model_error, the others go out as values. Only the error's kind
    and reason go out (a UnicodeEncodeError's text quotes the output)."""
    errors = dict(run.errors)
    for i, value in enumerate(out):
        problem = None if i in errors else _encoding_problem(value)
        if problem is not None:
            errors[i] = f"model output could not be encoded ({_reason(problem)})"
    values = [None if i in errors else value for i, value in enumerate(out)]
    try:
        return P.encoder.encode(P.BatchResult(batch_id, compute_ns, None, values, errors, run.oom, simulated, run.rejected))
    except Exception:   # each encodes alone, not all together: none of them goes out
        errors = {i: errors.get(i, f"model output could not be encoded ({_reason(exc)})") for i in range(len(run.outputs))}
        return P.encoder.encode(P.BatchResult(batch_id, compute_ns, None, None, errors, run.oom, simulated, run.rejected))


def _encoding_problem(value: Any) -> Exception | None:
    try:
        P.encoder.encode(value)
    except Exception as exc:
        return exc
    return None


def _reason(exc: Exception) -> str:
    """The error's kind and reason: a UnicodeError's own text quotes the output, so only its reason."""
    if isinstance(exc, UnicodeError):
        return f"{type(exc).__name__}: {exc.reason}"
    return describe(exc)


def decode_inputs(msg: P.BatchMsg, frames: list[bytes]) -> tuple[list[Any], list[int]]:
    """The batch's inputs as its runner takes them. A tensor that cannot be rebuilt becomes an
    `Undecodable`, answered bad_request alone (`execution.input_problem`): the front door checks
    every shape (`protocol.check_tensor`), but a decode that raised here once ended the worker,
    and with it every batch on the device."""
    inputs, tokens = [], []
    for item in msg.items:
        if item.text is not None:
            inputs.append(item.text)
        elif item.tensor is not None:
            ref = item.tensor
            try:
                inputs.append(np.frombuffer(frames[ref.frame], dtype=ref.dtype).reshape(ref.shape))
            except (ValueError, TypeError, IndexError, OverflowError) as exc:
                inputs.append(Undecodable(f"tensor could not be decoded ({type(exc).__name__})"))
        else:
            inputs.append(item.value)
        tokens.append(item.tokens)
    return inputs, tokens


def load_runners(setup: P.Setup, loaded: dict[str, Runner] | None = None) -> dict[str, Runner]:
    """The runners of `setup`'s models, loaded and warmed; those already in `loaded` are kept as
    they are (a reload's new model set: only the added ones load)."""
    from dynbatchd.plugins import Plugins

    if setup.threads:  # read by torch (and BLAS) at import: no need to import torch for other runners
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(setup.threads)
    registry = Plugins.load().runners()
    runners = {}
    for spec in setup.models:
        if loaded and spec.name in loaded:
            runners[spec.name] = loaded[spec.name]
            continue
        runner = registry[spec.runner](setup.device, spec.options)
        runner.load()
        runners[spec.name] = runner
    return runners


def serve(endpoint: str, name: str) -> int:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, name.encode())
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    sock.send(P.encoder.encode(P.Hello(os.getpid())))
    setup = P.daemon_decoder.decode(sock.recv())
    assert isinstance(setup, P.Setup)
    try:
        runners = load_runners(setup)
    except WorkerStopping:
        raise
    except BaseException as exc:   # SystemExit at a model's import once ended the worker without a word
        failure = describe(exc)   # (an exception whose __str__ raises: f"{exc}" ended the worker unheard)
        log.error("worker %s could not load its models: %s", name, failure)
        sock.send(P.encoder.encode(P.Failed(failure)))
        return 1
    simulated = [n for n, r in runners.items() if r.simulated]
    sock.send(P.encoder.encode(P.Ready(os.getpid(), setup.device, list(runners), simulated)))

    def send(done: Finished) -> None:
        # Wait until ZeroMQ has handed the result to the kernel before preparing another batch:
        # if a later batch kills this process, this result most likely reached the daemon already.
        # (the peak since the last result: this batch's, and with pipelining perhaps the next one's start)
        memory = batch_peak_bytes(setup.device)
        tracker = sock.send_multipart(encode_result(done.batch_id, done.run, done.compute_ns, done.simulated, done.prepare_ns,
                                                    memory),
                                      copy=False, track=True)
        try:
            tracker.wait(5.0)
        except zmq.NotDone:
            log.warning("result of batch %d not flushed after 5 s", done.batch_id)

    pipeline = Pipeline(send)
    generating = Generating(sock)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(pipeline.fileno(), zmq.POLLIN)
    parent = os.getppid()
    while True:
        events = dict(poller.poll(0 if generating.busy else 1000))
        if generating.busy:
            generating.step()   # one token boundary of every generating model
        if not events:
            if generating.busy:
                continue
            if os.getppid() != parent:
                return 0
            continue
        if pipeline.fileno() in events:
            pipeline.collect()   # a batch left the device: finish and send it
        if sock not in events:
            continue
        frames = sock.recv_multipart()
        msg = P.daemon_decoder.decode(frames[0])
        if isinstance(msg, P.Setup):   # a reload changed the model set: load the new, drop the removed
            runners = generating.runners = _adopt_models(sock, name, msg, runners)
            continue
        if isinstance(msg, (P.GenerateJob, P.GenerateCancel)):
            generating.handle(msg, runners)
            continue
        if not isinstance(msg, P.BatchMsg):
            continue
        if msg.model not in runners:   # (the daemon unloads a model only once nothing of it is left)
            missing = Execution(len(msg.items))
            missing.errors = {i: f"model {msg.model!r} is not loaded on this worker" for i in range(len(msg.items))}
            send(Finished(msg.batch_id, missing, 0, 0, 0, False))
            continue
        inputs, tokens = decode_inputs(msg, frames[1:])
        pipeline.submit(msg.batch_id, runners[msg.model], msg.model, inputs, tokens)


class Generating:
    """The worker's generation loops (`dynbatchd.generation.serving`), one per causal-lm model,
    stepped between reads of the socket while any has work."""

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.loops: dict[str, Any] = {}
        self.runners: dict[str, Runner] | None = None   # the models loaded, once a reload changed them

    @property
    def busy(self) -> bool:
        return any(loop.busy for loop in self.loops.values())

    def handle(self, msg: Any, runners: dict[str, Runner]) -> None:
        from dynbatchd.generation.serving import loop_for

        if isinstance(msg, P.GenerateCancel):
            for loop in self.loops.values():
                if (end := loop.cancel(msg.job, msg.reason)) is not None:
                    self._send(end)
            return
        runner = runners.get(msg.model)
        if runner is None or not hasattr(runner, "decode_step"):
            why = "is not loaded on this worker" if runner is None else "is not a generative (causal-lm) model"
            self._send(P.GenEnd(msg.job, "error", message=f"model {msg.model!r} {why}"))
            return
        loop = self.loops.get(msg.model)
        if loop is None or loop.runner is not runner:
            loop = self.loops[msg.model] = loop_for(runner, lambda: time.monotonic_ns() / 1e6)
        loop.take(msg)

    def step(self) -> None:
        for model, loop in list(self.loops.items()):
            if not loop.busy:
                continue
            try:
                messages = loop.step()
            except Exception as exc:   # the model failed a step: every job of it ends with model_error
                if (more := failed_step_lines.admit(model)) is not None:
                    log.error("model %s failed a generation step (%s)%s", model, type(exc).__name__, more)
                messages = [end for job in list(loop.jobs) if (end := loop.cancel(int(job), "error")) is not None]
                for end in messages:
                    end.message = f"model {model} failed a generation step ({type(exc).__name__})"
            for message in messages:
                self._send(message)
            if not loop.busy and self.runners is not None and self.runners.get(model) is not loop.runner:
                del self.loops[model]   # its model was unloaded: the loop held its runner, weights and all

    def _send(self, message: Any) -> None:
        self.sock.send(P.encoder.encode(message))


def _adopt_models(sock: zmq.Socket, name: str, setup: P.Setup, runners: dict[str, Runner]) -> dict[str, Runner]:
    """Load the models a reload added (while this worker's batch in flight finishes in the pipeline),
    drop those it removed, and say Ready again with what is loaded. Each added model loads on its
    own: one that fails is logged and reported in the Ready (`failed`), and the others still load;
    the daemon answers it unknown_model, saying why."""
    fresh: dict[str, Runner] = {}
    failed: dict[str, str] = {}
    for spec in setup.models:
        if spec.name in runners:
            fresh[spec.name] = runners[spec.name]
            continue
        try:
            fresh.update(load_runners(P.Setup(setup.device, [spec], setup.threads)))
        except WorkerStopping:
            raise
        except BaseException as exc:
            failed[spec.name] = describe(exc)
            log.error("worker %s could not load the reloaded model %s: %s", name, spec.name, failed[spec.name])
    for model in set(runners) - set(fresh):
        log.info("worker %s unloaded model %s", name, model)
    simulated = [n for n, r in fresh.items() if r.simulated]
    sock.send(P.encoder.encode(P.Ready(os.getpid(), setup.device, list(fresh), simulated, failed)))
    return fresh


def _stop(*_: Any) -> None:
    """SIGTERM: leave, through any model call under way (which lets only this BaseException through)."""
    raise WorkerStopping(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dynbatchd-worker", description="dynbatchd device worker (started by the daemon)")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-format", default="text", choices=FORMATS)
    args = parser.parse_args(argv)
    setup_logging(args.log_level, args.log_format, worker=args.name)
    withhold_stderr(log)   # the model's prints to stderr may hold payloads; the log lines above keep the real one
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when workers stop
    signal.signal(signal.SIGTERM, _stop)
    return serve(args.endpoint, args.name)


if __name__ == "__main__":
    sys.exit(main())
