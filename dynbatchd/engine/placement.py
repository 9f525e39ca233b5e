"""Placement: which open device takes a cut batch, on which feeder, and how much of it fits.

Mixed into `Engine`: it reads the device table (`devices`, `device_limits`, `device_speed`) and the
channels' learned costs; the slot rules themselves are `dynbatchd.engine.slots`, pure functions the
simulator's benchmarks may also patch.
"""

from __future__ import annotations

from dynbatchd.engine import slots
from dynbatchd.engine.slots import DeviceView, estimated_free_at
from dynbatchd.scheduler import Batch


class Placement:
    """The engine's placement methods (see the module docstring)."""

    def _estimate(self, batch: Batch, device: int | None = None) -> int:
        """A batch's compute time: as the channel learned it over every device, times what `device`
        learned of itself (a pool may mix devices of different speeds)."""
        base = self.channels[batch.channel].cost.estimate_ns(len(batch.items), batch.tokens)
        return base if device is None else int(base * self.device_speed.get((batch.channel, device), 1.0))

    def _inflight_ns(self, now_ns: int) -> int:
        """Device time the usable devices still have to run of the batches they hold (estimated):
        a request queued now waits for it before anything queued. Asked only when the scheduler
        predicts a wait (a backlog on busy devices), so per request past the peak; worked out once
        per clock reading (the daemon's drain of requests shares one) until a device's batches
        change (`_devices_changed`)."""
        memo = self._inflight_memo
        if memo is not None and memo[0] == now_ns:
            return memo[1]
        total = 0
        for i, d in enumerate(self.devices):
            if d.usable and d.held:
                total += max(0, estimated_free_at(d.held.values(), lambda b, i=i: self._estimate(b, i)) - now_ns)
        self._inflight_memo = (now_ns, total)
        return total

    def _devices_changed(self) -> None:
        """A batch was placed, ended or taken back, or a device came or went: `_inflight_ns` anew."""
        self._inflight_memo = None

    def _views(self) -> list[DeviceView]:
        views = []
        for i, d in enumerate(self.devices):   # (an idle device's end needs no estimate: one pass a request or two)
            free_at = estimated_free_at(d.held.values(), lambda b, i=i: self._estimate(b, i)) if d.held else 0
            views.append(DeviceView(len(d.held), free_at, d.usable and not d.exclusive, sum(d.up), int(d.prepare_ns)))
        return views

    def _place(self, batch: Batch, views: list[DeviceView], now_ns: int) -> int | None:
        """The open device on which `batch` would finish soonest (by each device's learned cost;
        fewest held on a tie), and there its least-loaded feeder. A retried request goes only to
        an idle device (every feeder idle) and runs there alone: if it kills its feeder too, it
        is certainly the cause."""
        exclusive = False
        for item in batch.items:   # (a loop, not any(): this runs once a batch)
            if item.retries:
                exclusive = True
                break
        choose = [DeviceView(v.held, v.free_at_ns, v.usable and v.held == 0, v.feeders, v.lead_ns)
                  for v in views] if exclusive else views
        index = slots.pick_device(choose, now_ns, self.inflight, self.lead_ns, lambda i: self._estimate(batch, i))
        if index is None:
            return None
        batch = self._fit(batch, index)
        view = views[index]
        end = (max(view.free_at_ns, now_ns) if view.held else now_ns) + self._estimate(batch, index)
        device = self.devices[index]
        device.feeder_of[batch.id] = device.least_loaded()
        device.held[batch.id] = (batch, now_ns)
        self._devices_changed()
        device.exclusive = exclusive
        device.stats.inflight = len(device.held)
        views[index] = DeviceView(view.held + 1, end, view.usable and not exclusive, view.feeders, view.lead_ns)
        return index

    def _fit(self, batch: Batch, index: int) -> Batch:
        """`batch` cut to what device `index` holds (its first items, in the scheduler's order); the
        rest goes back to the queue for the next device."""
        most_items, most_tokens = self.device_limits[index]
        if not most_items and not most_tokens:
            return batch
        keep, tokens = 0, 0
        for item in batch.items:
            if keep and ((most_items and keep >= most_items) or (most_tokens and tokens + item.tokens > most_tokens)):
                break
            keep, tokens = keep + 1, tokens + item.tokens
        if keep == len(batch.items):
            return batch
        self.scheduler.requeue(batch.items[keep:])
        return Batch(batch.id, batch.channel, batch.model, batch.items[:keep], batch.formed_ns,
                     min(batch.max_batch, most_items or batch.max_batch), tokens)
