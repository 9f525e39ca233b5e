"""The engine's read model: what drivers and adapters ask of it, and the one figure a worker
reports outside a result, without reaching into its device table.

Mixed into `Engine`. The daemon used to read `engine.devices[i].held` to match a late result, sum
`held` for its drain log and write `stats.batch_memory` itself; these methods say what it needs,
so the table's layout can change without the daemon changing with it.
"""

from __future__ import annotations

from dynbatchd.scheduler import Batch


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

    def note_batch_memory(self, device: int, feeder: int, peak_bytes: int) -> None:
        """A feeder's last batch peaked at `peak_bytes` allocated: what the adaptive sizers see of
        memory (summed over the device's feeders, see `dynbatchd.observer`)."""
        self.devices[device].stats.batch_memory[feeder] = peak_bytes
