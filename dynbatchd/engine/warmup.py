"""Warmup: cache-filling work fed a little at a time so it never crowds live traffic out.

Mixed into `Engine`: the backlog lives in `warmup_backlog`, its channel in `warmup_channel`.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from dynbatchd.engine.records import WARMUP_DEADLINE_NS, Job


class Warmup:
    """The engine's warmup methods (see the module docstring)."""

    def add_warmup(self, jobs: Iterable[Job], channel: str) -> tuple[int, int]:
        """Queue warmup jobs not cached yet, to be fed a little at a time; (queued, already cached)."""
        self.warmup_channel = channel
        queued = cached = 0
        for job in jobs:
            if self.cache is not None and job.cache_key in self.cache:
                cached += 1
            else:
                job.channel, job.warmup, job.deadline_ms = channel, True, WARMUP_DEADLINE_NS / 1e6
                self.warmup_backlog.append(job)
                queued += 1
        return queued, cached

    def forget_warmup(self, keys: set) -> int:
        """Drop the warmup inputs whose cache key is in `keys` from the backlog (how many); those
        already queued or running still run, but their results are not kept."""
        before = len(self.warmup_backlog)
        self.warmup_backlog = deque(job for job in self.warmup_backlog if job.cache_key not in keys)
        fed = [entry[2] for channel in self.channels.values() for lane in channel.lanes.values() if lane.warmup
               for entry in lane.heap]
        fed += [job for device in self.devices for batch, _ in device.held.values() for job in batch.items]
        for job in fed:
            if job.warmup and job.cache_key in keys:
                job.cache_key = None
        return before - len(self.warmup_backlog)

    def _feed_warmup(self, now_ns: int) -> None:
        """Top the warmup channel up to half its queue, so warmup never crowds live traffic out."""
        channel = self.channels[self.warmup_channel]
        room = channel.settings.queue_limit // 2 - channel.depth
        while room > 0 and self.warmup_backlog:
            job = self.warmup_backlog.popleft()
            self._keys += 1
            job.key, job.arrival_ns, job.deadline_ns = self._keys, now_ns, now_ns + WARMUP_DEADLINE_NS
            self.scheduler.submit(job, now_ns)
            room -= 1
