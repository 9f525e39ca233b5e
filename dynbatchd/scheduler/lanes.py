"""What a channel queues: `Item` (one request), `Lane` (one model's, tenant's or length bucket's
queue in deadline order) and `Batch` (what a lane's cut makes). Plain data with no policy, so the
channel, its admission and its planner share them without importing each other.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any


NEVER = 1 << 62


@dataclass(slots=True, eq=False)
class Item:
    """One queued request, as the scheduler sees it. `payload` is opaque to it."""
    key: int
    model: str
    arrival_ns: int
    deadline_ns: int
    tokens: int = 0
    tenant: str | None = None
    payload: Any = None
    channel: str = ""
    retries: int = 0
    queued: bool = False
    warmup: bool = False   # nobody waits: its batches count apart from live traffic's


@dataclass(slots=True, eq=False)
class Batch:
    id: int
    channel: str
    model: str
    items: list[Item]
    formed_ns: int
    max_batch: int
    tokens: int = 0
    planned_end_ns: int = 0   # when its plan said it would end (the learned cost); 0: no settled cost to say


@dataclass(slots=True, eq=False)
class Lane:
    model: str
    tenant: str | None
    bucket: int = 0                                 # length bucket (token_buckets), so short never pads to long
    warmup: bool = False                            # warmup inputs batch apart from live traffic
    heap: list = field(default_factory=list)        # (deadline_ns, key, item): most urgent first
    arrivals: deque = field(default_factory=deque)  # the same items in arrival order, taken ones skipped lazily
    tokens: int = 0

    def __len__(self) -> int:
        return len(self.heap)

    def push(self, item: Item) -> None:
        heapq.heappush(self.heap, (item.deadline_ns, item.key, item))
        self.tokens += item.tokens
        item.queued = True
        if self.arrivals and item.arrival_ns < self.arrivals[-1].arrival_ns:
            self.arrivals.appendleft(item)   # a requeued item: older than anything waiting
        else:
            self.arrivals.append(item)

    def pop(self) -> Item:
        item = heapq.heappop(self.heap)[2]
        self.tokens -= item.tokens
        item.queued = False
        return item

    def take(self, items: list[Item]) -> list[Item]:
        """Remove `items` (anywhere in the lane) and return them."""
        for item in items:
            item.queued = False
            self.tokens -= item.tokens
        self.heap = [entry for entry in self.heap if entry[2].queued]
        heapq.heapify(self.heap)
        return items

    def prune(self) -> None:
        """Forget taken items at the old end of `arrivals` (they would otherwise pile up)."""
        arrivals = self.arrivals
        while arrivals and not arrivals[0].queued:
            arrivals.popleft()

    @property
    def opened_ns(self) -> int:
        """Arrival of the oldest waiting item: where its batch's window starts (amortised O(1))."""
        self.prune()
        return self.arrivals[0].arrival_ns if self.arrivals else NEVER

    def head_deadline(self) -> int:
        return self.heap[0][0] if self.heap else NEVER
