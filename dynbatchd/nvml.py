"""NVML, read where there is an NVIDIA GPU: utilisation, memory and power of "cuda:N".

Out of `dynbatchd.telemetry` (which re-exports `NvmlProbe` for the callers that import it from
there) so telemetry stays pure counting and arithmetic: this module is the one that talks to a
driver. pynvml is imported only when a probe is made, and its absence is silence, not an error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


class NvmlProbe:
    """What NVML says of a GPU: utilisation, memory used and total, power draw; silent where
    there is no NVIDIA GPU (no pynvml, no driver, a device that is not "cuda:N").

    "cuda:N" is the Nth GPU the workers see: with CUDA_VISIBLE_DEVICES set, its Nth entry (an
    NVML index, or a GPU-/MIG- UUID), otherwise NVML index N. Each figure is read on its
    own, so a GPU that does not report power (or utilisation, as under MIG) still reports the
    rest; a figure NVML does not answer is None.
    """

    @dataclass(frozen=True, slots=True)
    class Reading:
        utilisation: float | None          # 0..1, over NVML's last sample period
        memory_used_bytes: int | None
        memory_total_bytes: int | None
        power_watts: float | None

        @property
        def memory_fraction(self) -> float | None:
            if self.memory_used_bytes is None or not self.memory_total_bytes:
                return None
            return self.memory_used_bytes / self.memory_total_bytes

    def __init__(self, nvml: Any = None) -> None:
        """`nvml`: the pynvml module, or a stand-in for tests; by default pynvml, initialised here."""
        self._nvml: Any = nvml
        self._handles: dict[str, Any] = {}
        if nvml is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception:
                self._nvml = None

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def _handle(self, device: str) -> Any:
        handle = self._handles.get(device)
        if handle is None:
            index = int(device.split(":", 1)[1])
            visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
            target = visible[index] if "CUDA_VISIBLE_DEVICES" in os.environ else str(index)
            if target.isdigit():
                handle = self._nvml.nvmlDeviceGetHandleByIndex(int(target))
            else:
                handle = self._nvml.nvmlDeviceGetHandleByUUID(target)
            self._handles[device] = handle
        return handle

    def sample(self, device: str) -> "NvmlProbe.Reading | None":
        """Every figure NVML answers for "cuda:N"; None without NVML, for another device, or
        when NVML answers none of them."""
        if self._nvml is None or not device.startswith("cuda:"):
            return None
        try:
            handle = self._handle(device)
        except Exception:
            return None
        nvml = self._nvml

        def ask(read: Any) -> Any:
            try:
                return read()
            except Exception:
                return None

        util = ask(lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
        mem = ask(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        power_mw = ask(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        reading = self.Reading(util, int(mem.used) if mem is not None else None,
                               int(mem.total) if mem is not None else None,
                               power_mw / 1000.0 if power_mw is not None else None)
        answered = (util, mem, power_mw)
        return reading if any(v is not None for v in answered) else None

    def name(self, device: str) -> str | None:
        """NVML's name for "cuda:N" (e.g. "NVIDIA H200"), or None."""
        if self._nvml is None or not device.startswith("cuda:"):
            return None
        try:
            name = self._nvml.nvmlDeviceGetName(self._handle(device))
        except Exception:
            return None
        return name.decode() if isinstance(name, bytes) else str(name)

    def read(self, device: str) -> tuple[float, float] | None:
        """(utilisation 0..1, memory used 0..1) for "cuda:N", or None unless NVML answers both."""
        reading = self.sample(device)
        if reading is None or reading.utilisation is None or reading.memory_fraction is None:
            return None
        return reading.utilisation, reading.memory_fraction
