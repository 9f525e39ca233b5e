"""Model runners: turn one batch of inputs into one batch of outputs on one device.

A runner is built as ``Runner(device, options)`` inside a worker process,
then ``load()`` is called once (and may be slow: imports, weights, warmup).
``run(inputs, tokens)`` takes a list of inputs (str, numpy array or a plain
msgpack value) and returns either a numpy array whose first axis is the
batch, or a list with one output per input. ``check(input)`` may reject one
input before it joins a batch. Runners raise `OutOfMemory` when a batch does
not fit, so the worker can split it and the scheduler can shrink the channel.

A runner may also split ``run`` into three stages, so that a pipelined worker
(`dynbatchd.devices.pipeline`) keeps the device busy while the CPU works:
``prepare`` (CPU: tokenise, build tensors), ``forward`` (the device) and
``finish`` (wait for the outputs, make them numpy or a list). The base class's
stages call ``run`` from ``forward``, so a runner that only has ``run`` works
unchanged; `StagedRunner` is the other way round (``run`` is the stages in a row).

This module holds the runner contract, the option checkers and the two small
runners (noop, callable); the others live beside it, one job each:
`dynbatchd.devices.simulated_runner` and `dynbatchd.devices.embedding`
(and `dynbatchd.devices.exported`). Their names are importable from here too.

A runner class declares the options it reads in ``OPTIONS`` (name ->
checker) and the required ones in ``REQUIRED``; `check_options` applies them
on the daemon side, at every config check, start and reload, without building
the runner (so without importing torch): an option not declared, a required
one missing, or a value the runner cannot use is a config error. A class
without ``OPTIONS`` (a plugin's that declares nothing) takes any option.
"""

from __future__ import annotations

import difflib
import importlib
import math
import os
import re
from typing import Any, Callable, Mapping

import numpy as np

from dynbatchd.devices.execution import OutOfMemory  # raised by runners, handled by execute
from dynbatchd.errors import OptionError  # an option a runner cannot use: .key (.option), .rule

MAX_MS = 86_400_000.0          # as dynbatchd.config.MAX_MS: one day
MAX_COUNT = 2**31 - 1


def milliseconds(value: Any) -> str | None:
    """Checker: a finite number of milliseconds, 0 to one day."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"expected a number of milliseconds, got {value!r}"
    if not (math.isfinite(value) and 0 <= value <= MAX_MS):
        return f"expected milliseconds >= 0 and <= {MAX_MS:.0f} (one day), got `{value!r}`"
    return None


def count(minimum: int) -> Callable[[Any], str | None]:
    """Checker: an integer from `minimum` to 2**31 - 1."""
    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_COUNT:
            return f"expected an integer >= {minimum} and <= {MAX_COUNT}, got `{value!r}`"
        return None
    return check


def one_of(*choices: str) -> Callable[[Any], str | None]:
    """Checker: one of the strings `choices`."""
    def check(value: Any) -> str | None:
        if value in choices and isinstance(value, str):
            return None
        return f"expected one of {', '.join(repr(c) for c in choices)}, got {value!r}"
    return check


def boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"expected true or false, got {value!r}"


def text(value: Any) -> str | None:
    return None if isinstance(value, str) and value else f"expected a non-empty string, got {value!r}"


def encoder_dir(value: Any) -> str | None:
    """Checker: a local Hugging Face model directory (config.json beside the weights and tokenizer)."""
    if not isinstance(value, str) or not value:
        return f"expected the path of a model directory, got {value!r}"
    if not os.path.isdir(value):
        return f"no such directory: {value!r}"
    if not os.path.isfile(os.path.join(value, "config.json")):
        return f"{value!r} has no config.json: not a Hugging Face model directory (save_pretrained writes one)"
    return None


_TARGET_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def target(value: Any) -> str | None:
    if isinstance(value, str) and _TARGET_RE.match(value):
        return None
    return f'expected "module:function", got {value!r}'


def check_options(runner: type, options: dict[str, Any]) -> None:
    """Raise OptionError for the first option `runner` does not declare, lacks, or cannot use.

    A runner class declares ``OPTIONS = {name: checker}`` (a checker returns
    why a value is unusable, or None) and may name required options in
    ``REQUIRED = {name: "how to write it"}``. A class without ``OPTIONS``
    (a plugin's that declares nothing) takes any option.
    """
    declared: dict[str, Callable[[Any], str | None]] | None = getattr(runner, "OPTIONS", None)
    if declared is None:
        return
    name_of = getattr(runner, "NAME", runner.__name__)
    for name, how in getattr(runner, "REQUIRED", {}).items():
        if name not in options:
            raise OptionError(name, f"required: the {name_of} runner needs {how}")
    for name, value in options.items():
        check = declared.get(name)
        if check is None:
            close = difflib.get_close_matches(name, declared, n=1)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            known = ", ".join(sorted(declared)) or "none"
            raise OptionError(name, f"unknown option of the {name_of} runner (known: {known}){hint}")
        problem = check(value)
        if problem:
            raise OptionError(name, problem)


class Runner:
    simulated = False

    def __init__(self, device: str, options: dict[str, Any]):
        self.device = device
        self.options = dict(options)

    def load(self) -> None:
        pass

    def check(self, item: Any) -> str | None:
        return None

    def run(self, inputs: list[Any], tokens: list[int]) -> np.ndarray | list[Any]:
        raise NotImplementedError

    def prepare(self, inputs: list[Any], tokens: list[int]) -> Any:
        """Stage 1, on the CPU, while the device runs the batch before: by default nothing (all in `run`)."""
        return inputs, tokens

    def forward(self, prepared: Any) -> Any:
        """Stage 2, the device's work; by default the whole `run`."""
        return self.run(*prepared)

    def finish(self, output: Any) -> np.ndarray | list[Any]:
        """Stage 3, on the CPU, while the device runs the batch after: the outputs as `run` returns them."""
        return output

    def device_ns(self, output: Any) -> int | None:
        """The device time of a batch the runner timed itself (CUDA events), read after `finish`;
        None: the time `forward` took is the device time."""
        return None

    # -- what the planner reads (dynbatchd.memory, dynbatchctl plan), without loading the model --
    @classmethod
    def model_directory(cls, options: dict[str, Any]) -> tuple[str, int | None] | None:
        """(the directory holding the model's config.json, the sequence cap) the planner sizes this
        runner's batches from, or None: nothing to plan from. By default ``options.path`` and
        ``options.max_tokens``: a third-party runner with those options is planned as a built-in is."""
        path = options.get("path")
        return (str(path), cls.sequence_cap(options)) if path else None

    @classmethod
    def sequence_cap(cls, options: dict[str, Any]) -> int | None:
        """The most tokens of one request the model reads (it truncates the rest), or None: every
        token counts. The engine counts a request's cost and memory at no more than this
        (`sequence_caps`). By default ``options.max_tokens``, as `model_directory`."""
        cap = options.get("max_tokens")
        return int(cap) if cap else None

    @classmethod
    def own_limit(cls, options: dict[str, Any], device: str) -> tuple[int, int] | None:
        """(items, tokens) a batch may hold on `device` by the runner's own account (0: no limit),
        overriding the planner's; None (the default): the planner decides from `model_directory`."""
        return None


class StagedRunner(Runner):
    """A runner written as its three stages: `run` is the stages in a row (the serial path, and
    the one `execute` bisects a failing batch with). A subclass overrides all three."""

    def run(self, inputs, tokens):
        return self.finish(self.forward(self.prepare(inputs, tokens)))


class NoopRunner(Runner):
    """Answers at once: measures the daemon's own per-request cost. Takes no options."""

    NAME = "noop"
    OPTIONS = {}
    INLINE = True   # nothing to overlap: the worker's pipeline runs it in its own thread (devices/pipeline.py)

    def run(self, inputs, tokens):
        return [0] * len(inputs)



class CallableRunner(Runner):
    """A user's ``module:function`` taking a list of inputs and returning a list of outputs.

    Options: target (required). path (a model directory with a config.json)
    and max_tokens describe the model for `dynbatchctl plan` and the daemon's
    per-device batch limits (`dynbatchd.memory.device_limits`); the function never sees them.
    """

    NAME = "callable"
    OPTIONS = {"target": target, "path": text, "max_tokens": count(1)}
    REQUIRED = {"target": 'options.target = "module:function"'}

    def load(self):
        target = self.options.get("target")
        if not target or ":" not in str(target):
            raise ValueError('callable runner needs options.target = "module:function"')
        module, _, name = str(target).partition(":")
        self.fn = getattr(importlib.import_module(module), name)
        if not callable(self.fn):   # else it loads, and every request fails model_error (TypeError)
            raise ValueError(f"callable runner: {target} is a {type(self.fn).__name__}, not a function "
                             "(options.target names a function taking a list of inputs)")

    def run(self, inputs, tokens):
        outputs = self.fn(inputs)
        if isinstance(outputs, (Mapping, str, bytes, set, frozenset)):   # len() matches, list() does not
            raise ValueError(f"{self.options['target']} returned a {type(outputs).__name__}, not a list of outputs")
        if len(outputs) != len(inputs):
            raise ValueError(f"{self.options['target']} returned {len(outputs)} outputs for {len(inputs)} inputs")
        return outputs if isinstance(outputs, np.ndarray) else list(outputs)   # an array: tensor replies


# The runners that live in sibling modules, importable from here as before (loaded on first use,
# so that importing the contract does not import them, and they can import it).
_ELSEWHERE = {
    "SimulatedRunner": "simulated_runner", "DEVICE_LOCKS_ENV": "simulated_runner", "burn_cpu": "simulated_runner",
    "device_turn": "simulated_runner", "per_device": "simulated_runner", "simulated_options": "simulated_runner",
    "SIMULATED_OPTIONS": "simulated_runner",
    "SentenceEmbeddingRunner": "embedding", "default_model_path": "embedding",
}


def __getattr__(name: str) -> Any:
    module = _ELSEWHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"dynbatchd.devices.{module}"), name)


def sequence_caps(models: Mapping[str, Any] | None, runners: Mapping[str, Any]) -> dict[str, int]:
    """Model name -> the tokens of one request its runner reads at most (`Runner.sequence_cap`),
    for the models whose runner says; `models`: a config's ``[models]`` (None: none known)."""
    caps = {}
    for name, settings in (models or {}).items():
        runner = runners.get(settings.runner)
        cap = runner.sequence_cap(dict(settings.options)) if hasattr(runner, "sequence_cap") else None
        if cap:
            caps[name] = cap
    return caps
