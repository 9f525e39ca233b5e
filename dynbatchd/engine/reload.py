"""Reload: channels and models a config reload adds or removes while requests are in flight.

Mixed into `Engine`: a removed channel retires (answered as usual, dropped once empty), a model is
unloaded only once the engine holds none of its requests.
"""

from __future__ import annotations

from typing import Sequence

from dynbatchd.scheduler import Channel


class Reloads:
    """The engine's reload methods (see the module docstring)."""

    def add_channel(self, channel: Channel) -> None:
        """A channel of a reload's config: a new one is routable at once; one the engine runs takes
        the new settings in place, keeping its queue and what it learned (one still draining after
        an earlier removal is taken back)."""
        if channel.name in self.channels:
            self.retiring.discard(channel.name)
            self.channels[channel.name].retune(channel.settings, channel)
            return
        self.scheduler.add_channel(channel)

    def retire_channel(self, name: str) -> None:
        """A channel a reload removed: it takes no new request (submit refuses one), what it holds
        is answered as usual, and step() then drops it (as it drops an ended canary's twin)."""
        if name in self.channels:
            self.retiring.add(name)
        if name == self.warmup_channel:   # warmup is optional work: its backlog goes with the channel
            self.warmup_backlog.clear()
            self.warmup_channel = None

    def holds_model(self, model: str) -> bool:
        """Whether a request for `model` is still queued, running or in the warmup backlog: a model
        a reload removed is unloaded from the devices only once none is."""
        if any(job.model == model for job in self.warmup_backlog):
            return True
        if any(lane.model == model and lane.heap for channel in self.channels.values()
               for lane in channel.lanes.values()):
            return True
        return any(batch.model == model for d in self.devices for batch, _ in d.held.values())

    def set_device_limits(self, limits: Sequence[tuple[int, ...]]) -> None:
        """Each device's batch limit again, after a reload changed the models it holds (sized per device)."""
        self.device_limits = [(lim[0], lim[1]) for lim in limits]
        self.limit_sources = [lim[2] if len(lim) > 2 else "runner" if any(lim) else "" for lim in limits]
        self.mixed_pool = len(set(self.device_limits)) > 1
