"""Canary splits: a channel's traffic shared with a twin running candidate settings until the
judge decides.

Mixed into `Engine`. A split that ends is announced as a `VerdictEvent` in the engine's outbox,
never by calling out: the driver applies the verdict (a config change) after the engine call
returns, so no channel is rebuilt while the engine is still looping over a batch.
"""

from __future__ import annotations

import copy
from typing import Any

from dynbatchd.engine.events import VerdictEvent
from dynbatchd.engine.records import Split
from dynbatchd.scheduler import Channel


class Canaries:
    """The engine's canary methods (see the module docstring)."""

    def start_split(self, channel: str, twin: Channel, judge: Any, *, shadow: bool = False) -> Split:
        """Share `channel`'s traffic with `twin` (the candidate's settings) as `judge` says, until it
        decides; the twin starts with what the channel has learned of its cost on each device."""
        if self.splits:
            raise ValueError(f"a canary of channel {next(iter(self.splits))!r} is already running")
        if twin.name in self.channels:
            raise ValueError(f"channel {twin.name!r} still exists (a canary that ended is still draining)")
        incumbent = self.channels[channel]
        twin.cost = copy.deepcopy(incumbent.cost)
        for (name, device), speed in list(self.device_speed.items()):
            if name == channel:
                self.device_speed[(twin.name, device)] = speed
        self.scheduler.add_channel(twin)
        split = self.splits[channel] = Split(channel, twin.name, judge, shadow)
        self._arms[channel], self._arms[twin.name] = (split, False), (split, True)
        return split

    def end_split(self, channel: str, verdict: Any) -> Split | None:
        """Stop sharing `channel`'s traffic (the judge's verdict, or an operator's); what the twin
        holds still runs there, and the twin is removed once it is empty."""
        split = self.splits.pop(channel, None)
        if split is None:
            return None
        split.verdict = verdict
        self._arms.pop(split.channel, None)
        self._arms.pop(split.twin, None)
        self.retiring.add(split.twin)
        self.outbox.append(VerdictEvent(split))
        return split

    def _judged(self, channel: str, on_time: bool, latency_ns: int, now_ns: int) -> None:
        arm = self._arms.get(channel) if self._arms else None
        if arm is None:
            return
        split, candidate = arm
        split.judge.record(candidate, on_time, latency_ns)
        verdict = split.judge.decide(now_ns)
        if verdict is not None:
            self.end_split(split.channel, verdict)

    def _review_splits(self, now_ns: int) -> None:
        """A canary whose time is up ends even without traffic; an ended twin goes once empty."""
        for split in list(self.splits.values()):
            verdict = split.judge.decide(now_ns)
            if verdict is not None:
                self.end_split(split.channel, verdict)
        for twin in list(self.retiring):
            if not self.channels[twin].depth and not any(b.channel == twin for d in self.devices
                                                          for b, _ in d.held.values()):
                self.retiring.discard(twin)
                self.scheduler.remove_channel(twin)
                for key in [k for k in self.device_speed if k[0] == twin]:
                    del self.device_speed[key]
