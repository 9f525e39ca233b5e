"""The `simulated` runner: a latency model of an accelerator, slept for real in a worker process.

Its formula (`dynbatchd.devices.latency.DeviceModel`) is the simulator's too;
this module adds what only a live worker needs: CPU really burnt per item
(standing in for tokenising) and a lock file that several feeders of one
device take turns at, as they would at a GPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from typing import Any

import numpy as np

from dynbatchd.config import DEVICE_NAME
from dynbatchd.devices.execution import OutOfMemory
from dynbatchd.devices.latency import DeviceModel
from dynbatchd.devices.runners import StagedRunner, count, milliseconds

_CHUNK = bytes(16384)


def burn_cpu(ms: float) -> None:
    """Use `ms` of this thread's CPU time for real, as tokenising would: hashing, which (like the
    tokenizers and torch) releases the GIL, so a device stage in another thread is not held up."""
    end = time.thread_time_ns() + round(ms * 1_000_000)
    while time.thread_time_ns() < end:
        hashlib.blake2b(_CHUNK)


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

    @classmethod
    def own_limit(cls, options: dict[str, Any], device: str) -> tuple[int, int]:
        """The simulated device's own memory (memory_items / memory_tokens on `device`), not a planner's."""
        opts = simulated_options(options, device)
        return int(opts.get("memory_items", 0)), int(opts.get("memory_tokens", 0))

    def __init__(self, device, options):
        super().__init__(device, options)
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
