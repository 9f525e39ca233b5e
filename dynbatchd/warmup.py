"""Feeding warmup inputs into the scheduler a little at a time.

`dynbatchctl warmup` may name tens of thousands of inputs; queuing them all
at once would fill the warmup channel and refuse live traffic there. They
wait in a backlog instead, and each scheduling pass tops the warmup channel
up to half its queue. Their items carry no reply address: their results only
fill the cache.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from dynbatchd import protocol as P
from dynbatchd.cache import ResultCache
from dynbatchd.scheduler import Item, Scheduler

WARMUP_DEADLINE_NS = 3_600 * 10**9   # warmup is never urgent, and never answered deadline_exceeded


class WarmupFeeder:
    def __init__(self, scheduler: Scheduler, next_key: Callable[[], int]):
        self.scheduler = scheduler
        self.next_key = next_key
        self.backlog: deque[tuple[str, str]] = deque()

    def add(self, model: str, inputs: list[str], cache: ResultCache) -> tuple[int, int]:
        """Queue the inputs not cached yet; returns (queued, already cached)."""
        queued = cached = 0
        for text in inputs:
            if (model, None, text) in cache:
                cached += 1
            else:
                self.backlog.append((model, text))
                queued += 1
        return queued, cached

    def feed(self, channel_name: str, now_ns: int) -> None:
        """Top the warmup channel up to half its queue from the backlog."""
        channel = self.scheduler.channels[channel_name]
        room = channel.settings.queue_limit // 2 - channel.depth
        while room > 0 and self.backlog:
            model, text = self.backlog.popleft()
            request = P.Request(0, model, text=text)
            item = Item(self.next_key(), model, now_ns, now_ns + WARMUP_DEADLINE_NS, P.estimate_tokens(request),
                        None, (None, request, []), channel_name)
            self.scheduler.submit(item, now_ns)
            room -= 1
