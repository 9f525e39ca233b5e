"""Batches on the worker wire: a scheduler Batch out as a BatchMsg, a BatchResult back as an Outcome.

The daemon's half of the daemon <-> worker protocol (the worker's half is
`dynbatchd.devices.worker`). Arrays travel as raw frames both ways; a
result's stacked output is cut into per-request (TensorRef, view) pairs here,
without copying. It lives beside the daemon, not in `dynbatchd.devices`: it speaks the
engine's types (Outcome), and the devices layer never imports the engine.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from dynbatchd import protocol as P
from dynbatchd.engine import Outcome
from dynbatchd.scheduler import Batch


class Pending:
    """A live request while the engine holds it: where to reply, what was asked, its frames.
    `envelope` is None for a warmup input (nobody waits for it). (A slotted class, not a
    NamedTuple: one is made per request, and a NamedTuple's constructor costs twice as much.)"""
    __slots__ = ("envelope", "request", "frames")

    def __init__(self, envelope: list[bytes] | None, request: P.Request, frames: list[bytes] | tuple = ()):
        self.envelope, self.request, self.frames = envelope, request, frames


def fingerprint(pending: Pending) -> bytes:
    """Identity of a request's input (for the poison quarantine); computed only when needed."""
    request = pending.request
    h = hashlib.blake2b(request.model.encode(), digest_size=16)
    if request.text is not None:
        h.update(b"t" + request.text.encode("utf-8", "surrogatepass"))   # (a lone surrogate from the HTTP door)
    elif request.tensor is not None:
        h.update(b"a" + msgspec.msgpack.encode(request.tensor) + bytes(pending.frames[request.tensor.frame]))
    else:
        h.update(b"v" + msgspec.msgpack.encode(request.value))
    return h.digest()


def encode_batch(batch: Batch) -> list[Any]:
    """BatchMsg header plus the tensor frames of its requests, renumbered."""
    items, frames = [], []
    for item in batch.items:
        pending: Pending = item.payload   # (the item is the engine's Job)
        request = pending.request
        if request.tensor is not None:
            ref = P.TensorRef(request.tensor.dtype, request.tensor.shape, len(frames))
            frames.append(pending.frames[request.tensor.frame])
            items.append(P.BatchItem(tensor=ref, tokens=item.tokens))
        else:
            items.append(P.BatchItem(text=request.text, value=request.value, tokens=item.tokens))
    return [P.encoder.encode(P.BatchMsg(batch.id, batch.model, items)), *frames]


def unencodable(batch: Batch) -> dict[int, str]:
    """The items of a batch that `encode_batch` failed on which cannot be encoded even alone
    (index -> the error's name), e.g. a text with a lone surrogate, which JSON can carry and
    UTF-8 cannot. Empty: each item encodes alone, so the fault is not any one input's."""
    bad = {}
    for i, item in enumerate(batch.items):
        try:
            encode_batch(Batch(batch.id, batch.channel, batch.model, [item], batch.formed_ns, 1))
        except Exception as exc:   # (its reason, not its text: the input stays out of the message)
            reason = getattr(exc, "reason", "")
            bad[i] = f"{type(exc).__name__}: {reason}" if isinstance(reason, str) and reason else type(exc).__name__
    return bad


def decode_outcome(result: P.BatchResult, frames: list[bytes], n: int) -> Outcome:
    """A worker's answer for a batch of `n` as the engine takes it; per-item outputs are
    (TensorRef, memoryview) for arrays and (value, None) for plain values."""
    problem = result_problem(result, frames, n)
    outcome = Outcome(result.compute_ns, errors=result.errors, rejected=result.rejected, oom=result.oom,
                      simulated=result.simulated, problem=problem, prepare_ns=result.prepare_ns)
    if problem:
        return outcome
    if result.output is not None:
        buf = memoryview(frames[0])
        row = len(buf) // n if n else 0
        ref = P.TensorRef(result.output.dtype, result.output.shape[1:], 0)
        outcome.outputs = [(ref, buf[i * row:(i + 1) * row]) for i in range(n)]
    elif result.values is not None:
        outcome.outputs = [(value, None) for value in result.values]
    return outcome


def freeze(output: Any) -> Any:
    """What the cache keeps of an output: the bytes themselves, not a view pinning the batch's frame."""
    value, data = output
    return value, (bytes(data) if data is not None else None)


def result_problem(result: P.BatchResult, frames: list[bytes], n: int) -> str | None:
    """Why a worker's answer cannot be split into `n` replies, or None."""
    if result.output is not None:
        if not result.output.shape or result.output.shape[0] != n:
            return f"output shape {result.output.shape} for a batch of {n}"
        return P.check_tensor(result.output, [len(f) for f in frames])
    if result.values is None and len(result.errors) == n:
        return None   # every input failed on its own: each has its error
    if result.values is None or len(result.values) != n:
        return f"{0 if result.values is None else len(result.values)} outputs for a batch of {n}"
    return None
