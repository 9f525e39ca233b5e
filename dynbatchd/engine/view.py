"""The engine's read model: what drivers, adapters and the status page ask of it, and the
figures a worker reports outside a result, without reaching into its tables.

Mixed into `Engine`. Outside `dynbatchd.engine` nothing reads or writes the engine's own
attributes (its channels, device table, splits, counters): it asks these methods, which hand
back copies, read-only views or plain figures, and changes the engine through its commands
(`submit`, `add_channel`, `note_batch_memory`, `count_generated`...), so the tables' layout can
change without the daemon changing with it. tests/project/test_engine_state.py checks it.
Two fields are read directly, on the request path where a call would cost: `PUBLIC_FIELDS`.
None of these methods runs per request; they serve status, metrics and the once-a-second beat.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, NamedTuple

from dynbatchd.engine.records import Split
from dynbatchd.scheduler import Batch
from dynbatchd.telemetry import Histogram

# Attributes a driver may read as plain values (never assign, index or call methods on): how many
# feeders each device has (fixed at construction; the pool numbers workers by it), and whether the
# outbox holds anything (looked at after each call; `take_events` takes it).
PUBLIC_FIELDS = frozenset({"feeders", "outbox"})


class DeviceUsage(NamedTuple):
    """What the observer needs of one device at a beat: its name, the compute time it has
    spent so far, and each feeder's last batch peak in bytes (a copy)."""
    name: str
    busy_ns: int
    batch_memory: dict[int, int]


class ReadModel:
    """The engine's read methods (see the module docstring)."""

    def held_batch(self, device: int, batch_id: int) -> Batch | None:
        """The batch `device` holds under `batch_id`; None: already answered (lost, stopped) or never sent."""
        entry = self.devices[device].held.get(batch_id)
        return entry[0] if entry is not None else None

    def batches_in_flight(self) -> int:
        """Batches sent to devices and not yet answered, over every device."""
        return sum(len(d.held) for d in self.devices)

    def queued(self) -> int:
        """Requests waiting in the scheduler's queues."""
        return self.scheduler.depth()

    def every_device_gone(self) -> bool:
        """Whether every device is given up (requests are answered unavailable until one returns)."""
        return all(d.gone for d in self.devices)

    def has_channel(self, name: str) -> bool:
        """Whether the engine runs channel `name` (a canary's twin and a retiring channel included)."""
        return name in self.channels

    def splits_running(self) -> Mapping[str, Split]:
        """The running canaries, by incumbent channel (a read-only view: `end_split` ends one)."""
        return MappingProxyType(self.splits)

    def latency_lifetimes(self) -> dict[str, Histogram]:
        """Each channel's latency since the start, merged anew (a copy): the /metrics histograms."""
        return {name: channel.stats.latency.lifetime for name, channel in self.channels.items()}

    def warmup_waiting(self) -> int:
        """Warmup requests queued in the backlog, not yet handed to the scheduler."""
        return len(self.warmup_backlog)

    def device_usage(self) -> list[DeviceUsage]:
        """Each device's name, busy time and feeders' batch peaks, for the observer's beat."""
        return [DeviceUsage(d.name, d.stats.busy_ns, dict(d.stats.batch_memory)) for d in self.devices]

    def note_batch_memory(self, device: int, feeder: int, peak_bytes: int) -> None:
        """A feeder's last batch peaked at `peak_bytes` allocated: what the adaptive sizers see of
        memory (summed over the device's feeders, see `dynbatchd.observer`)."""
        self.devices[device].stats.batch_memory[feeder] = peak_bytes
