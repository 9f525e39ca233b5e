"""Two forty-line yardsticks for trace replays (not part of the daemon).

Both run one simulated device and dispatch whenever it is idle; neither knows
priorities, fairness or long requests, which is why the daemon does not use
them. They answer: how many requests could a simple rule get on time here?

- `fifo_drop_hopeless`: drop every queued request that could not finish in
  time even alone, take the oldest up to `max_batch`, and shrink the batch
  until its oldest member would still finish in time.
- `feasible_shortest_first`: among the requests that can still finish in time,
  add them shortest first while every member of the batch still finishes in time.
- `edf_plan_drop_largest`: an online planner (Moore and Hodgson's rule, for
  batches): the queue in deadline order, cut into full batches; while the last
  planned batch would be late, drop the largest request from the plan; run the
  plan's first batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

from dynbatchd.simulate import Arrival, DeviceModel

MS = 1_000_000


@dataclass
class Yardstick:
    on_time: list[bool]     # per arrival (in the order given)

    def share(self, index: Sequence[int] | None = None) -> float:
        picked = range(len(self.on_time)) if index is None else index
        picked = list(picked)
        return sum(self.on_time[i] for i in picked) / len(picked) if picked else 1.0


def _replay(arrivals: Sequence[Arrival], device: DeviceModel, deadline_ms: float, max_batch: int,
            choose) -> Yardstick:
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i].at_ns)
    deadline = [arrivals[i].at_ns + int(deadline_ms * MS) for i in range(len(arrivals))]
    on_time = [False] * len(arrivals)
    queue: deque[int] = deque()
    now, k = 0, 0
    while k < len(order) or queue:
        if not queue:
            now = max(now, arrivals[order[k]].at_ns)
        while k < len(order) and arrivals[order[k]].at_ns <= now:
            queue.append(order[k])
            k += 1
        batch = choose(queue, now, deadline, arrivals, device, max_batch)
        if not batch:
            if k < len(order):
                now = max(now, arrivals[order[k]].at_ns)
            continue
        end = now + device.latency_ns(len(batch), sum(arrivals[i].tokens for i in batch))
        for i in batch:
            on_time[i] = end <= deadline[i]
        now = end
    return Yardstick(on_time)


def _alone_in_time(i: int, now: int, deadline, arrivals, device) -> bool:
    return now + device.latency_ns(1, arrivals[i].tokens) <= deadline[i]


def fifo_drop_hopeless(arrivals, device: DeviceModel, deadline_ms: float, max_batch: int = 32) -> Yardstick:
    def choose(queue, now, deadline, arrivals, device, max_batch):
        kept = [i for i in queue if _alone_in_time(i, now, deadline, arrivals, device)]
        queue.clear()
        batch = kept[:max_batch]
        while batch and now + device.latency_ns(len(batch), sum(arrivals[i].tokens for i in batch)) > deadline[batch[0]]:
            batch.pop()
        queue.extend(i for i in kept if i not in set(batch))
        return batch
    return _replay(arrivals, device, deadline_ms, max_batch, choose)


def feasible_shortest_first(arrivals, device: DeviceModel, deadline_ms: float, max_batch: int = 32) -> Yardstick:
    def choose(queue, now, deadline, arrivals, device, max_batch):
        feasible = sorted((i for i in queue if _alone_in_time(i, now, deadline, arrivals, device)),
                          key=lambda i: arrivals[i].tokens)
        queue.clear()
        batch, tokens, earliest = [], 0, None
        for i in feasible:
            if len(batch) == max_batch:
                queue.append(i)
                continue
            end = now + device.latency_ns(len(batch) + 1, tokens + arrivals[i].tokens)
            limit = deadline[i] if earliest is None else min(earliest, deadline[i])
            if end <= limit:
                batch.append(i)
                tokens += arrivals[i].tokens
                earliest = limit
            else:
                queue.append(i)
        return batch
    return _replay(arrivals, device, deadline_ms, max_batch, choose)


def edf_plan_drop_largest(arrivals, device: DeviceModel, deadline_ms: float, max_batch: int = 32) -> Yardstick:
    base, per_item, per_token = device.base_ms * MS, device.per_item_ms * MS, device.per_token_ms * MS

    def choose(queue, now, deadline, arrivals, device, max_batch):
        feasible = sorted((i for i in queue if _alone_in_time(i, now, deadline, arrivals, device)),
                          key=lambda i: deadline[i])
        queue.clear()
        kept, tokens = [], 0
        for i in feasible:
            kept.append(i)
            tokens += arrivals[i].tokens
            while kept:
                batches = -(-len(kept) // max_batch)
                end = now + batches * base + len(kept) * per_item + tokens * per_token
                if end <= deadline[kept[(batches - 1) * max_batch]]:
                    break
                largest = max(range(len(kept)), key=lambda j: arrivals[kept[j]].tokens)
                tokens -= arrivals[kept.pop(largest)].tokens
        batch = kept[:max_batch]
        chosen = set(batch)
        queue.extend(i for i in feasible if i not in chosen)
        return batch
    return _replay(arrivals, device, deadline_ms, max_batch, choose)
