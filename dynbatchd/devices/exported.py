"""Runners for models exported ahead of time: TorchScript and `torch.export` programs.

Users bring the file their training pipeline already writes (``torch.jit.save`` or
``torch.export.save``); no Python model code is needed at serve time. Both runners
share one contract: each request carries one input per declared input name (a
tensor frame or a nested list when the model has one input, a table ``{name:
list}`` when it has several), the batch is stacked along a new first axis in the
declared dtypes, and the program's first output (a tensor, or the first tensor of
a tuple) is split back into one row per request.

A program with a fixed batch size (``batch_size = N``; without it the first
dimension is taken to be dynamic) runs batches padded to N (larger ones in chunks
of N): the scheduler may batch freely while the program sees the only shape it
knows.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from dynbatchd.devices.execution import OutOfMemory
from dynbatchd.devices.runners import Runner, count

DTYPES = ("float32", "float16", "float64", "int64", "int32", "uint8", "bool")
_NAME_RE = re.compile(r"^[A-Za-z_]\w*$")


def existing_file(value: Any) -> str | None:
    """Checker: the path of a readable file (checked at config time, so a typo fails before any worker starts)."""
    if not isinstance(value, str) or not value:
        return f"expected the path of a model file, got {value!r}"
    if not os.path.isfile(value):
        return f"no such file: {value!r}"
    if not os.access(value, os.R_OK):
        return f"not readable by the daemon: {value!r}"
    return None


def input_specs(value: Any) -> str | None:
    """Checker: ``[{ name = "x", dtype = "float32", shape = [4] }, ...]``, shape optional."""
    if not isinstance(value, list) or not value:
        return 'expected a list of inputs such as [{ name = "x", dtype = "float32" }]'
    seen = set()
    for i, spec in enumerate(value):
        where = f"[{i}]"
        if not isinstance(spec, dict):
            return f'{where}: expected a table such as {{ name = "x", dtype = "float32" }}, got {spec!r}'
        unknown = set(spec) - {"name", "dtype", "shape"}
        if unknown:
            return f"{where}: unknown key {sorted(unknown)[0]!r} (known: dtype, name, shape)"
        name = spec.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            return f"{where}.name: expected an identifier, got {name!r}"
        if name in seen:
            return f"{where}.name: {name!r} is declared twice"
        seen.add(name)
        if spec.get("dtype", "float32") not in DTYPES:
            return f"{where}.dtype: expected one of {', '.join(DTYPES)}, got {spec.get('dtype')!r}"
        shape = spec.get("shape")
        if shape is not None and (not isinstance(shape, list) or
                                  not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape)):
            return f"{where}.shape: expected the per-request shape as a list of integers >= 1, got {shape!r}"
    return None


class _ProgramRunner(Runner):
    """What the TorchScript and torch.export runners share: inputs in, first output out."""

    OPTIONS = {"path": existing_file, "inputs": input_specs, "batch_size": count(1)}

    @classmethod
    def model_directory(cls, options: dict[str, Any]) -> None:
        """A program file has no config.json to plan from."""
        return None
    REQUIRED = {"path": 'options.path = "/path/to/the/model file"'}

    def __init__(self, device, options):
        super().__init__(device, options)
        specs = options.get("inputs") or [{"name": "input", "dtype": "float32"}]
        self.inputs = [(s["name"], s.get("dtype", "float32"), tuple(s["shape"]) if s.get("shape") else None)
                       for s in specs]
        self.batch_size = options.get("batch_size")   # None: the batch dimension is dynamic

    def load(self):
        import torch

        self.torch = torch
        self.program = self.load_program(torch, self.options["path"])

    def load_program(self, torch: Any, path: str) -> Any:
        raise NotImplementedError

    def _arrays(self, item: Any) -> list[np.ndarray] | str:
        """One request's inputs in declaration order, each in its dtype, or why not."""
        if len(self.inputs) == 1:
            values = [item]
        elif isinstance(item, dict) and set(item) == {n for n, _, _ in self.inputs}:
            values = [item[n] for n, _, _ in self.inputs]
        else:
            names = ", ".join(n for n, _, _ in self.inputs)
            return f"{self.NAME} model takes a table with exactly the inputs {names}"
        out = []
        for value, (name, dtype, shape) in zip(values, self.inputs):
            if isinstance(value, (str, bytes)) or value is None:
                return f"input {name!r}: expected numbers (a tensor or a list), got {type(value).__name__}"
            try:
                array = np.asarray(value, dtype=dtype)
            except (TypeError, ValueError):
                return f"input {name!r}: not an array of {dtype}"
            if shape is not None and array.shape != shape:
                return f"input {name!r}: expected shape {list(shape)}, got {list(array.shape)}"
            out.append(array)
        return out

    def check(self, item):
        problem = self._arrays(item)
        return problem if isinstance(problem, str) else None

    def run(self, inputs, tokens):
        per_request = [self._arrays(item) for item in inputs]
        stacked = [np.stack([arrays[k] for arrays in per_request]) for k in range(len(self.inputs))]
        if self.batch_size is None:
            return self._call(stacked)
        n, size, parts = len(inputs), self.batch_size, []
        for start in range(0, n, size):
            chunk = [a[start:start + size] for a in stacked]
            short = size - len(chunk[0])
            if short:   # pad with copies of the last row: the program knows one batch size only
                chunk = [np.concatenate([a, np.repeat(a[-1:], short, axis=0)]) for a in chunk]
            parts.append(self._call(chunk)[:size - short])
        return np.concatenate(parts)

    def _call(self, arrays: list[np.ndarray]) -> np.ndarray:
        torch = self.torch
        try:
            with torch.inference_mode():
                tensors = [torch.from_numpy(np.ascontiguousarray(a)).to(self.device) for a in arrays]
                out = self.program(*tensors)
                if isinstance(out, (tuple, list)):
                    out = out[0]
                if not isinstance(out, torch.Tensor):
                    raise TypeError(f"the program returned {type(out).__name__}, not a tensor")
                return out.detach().cpu().numpy()
        except torch.cuda.OutOfMemoryError as exc:
            torch.cuda.empty_cache()
            raise OutOfMemory(str(exc).splitlines()[0]) from None


class TorchScriptRunner(_ProgramRunner):
    """A TorchScript program (``torch.jit.script`` or ``torch.jit.trace``, then ``torch.jit.save``).

    Options: path (required), inputs (names, dtypes, optional per-request shapes;
    default one float32 input named ``input``), batch_size (only for a program
    traced with one fixed batch size: that size).
    """

    NAME = "torchscript"

    def load_program(self, torch, path):
        import warnings

        with warnings.catch_warnings():   # torch deprecates TorchScript; the files people have still load
            warnings.simplefilter("ignore", DeprecationWarning)
            program = torch.jit.load(path, map_location=self.device)
        program.eval()
        return program


class ExportedRunner(_ProgramRunner):
    """A `torch.export` program (``torch.export.export``, then ``torch.export.save``, a .pt2 file).

    Same options as the TorchScript runner. A program exported without a dynamic
    batch dimension (``torch.export.Dim``) takes one batch size only: set
    batch_size to it.
    """

    NAME = "exported"

    def load_program(self, torch, path):
        return torch.export.load(path).module().to(self.device)
