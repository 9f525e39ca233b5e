"""A channel: bounded queues in deadline order, and the rule for when a batch is ready.

A channel holds one *lane* per model (and, for isolated channels, per tenant;
with ``token_buckets``, per length bucket): a batch is always cut from one
lane, so requests of different models, or of different tenants of a regulated
channel, never share a batch, and short requests never pad up to long ones.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable

from dynbatchd.scheduler.longshare import LongShare
from dynbatchd.scheduler.cost import CostModel
from dynbatchd.scheduler.policies import MS, BatchSizer, LaneState, WindowPolicy
from dynbatchd.telemetry import ChannelStats

NEVER = 1 << 62
log = logging.getLogger("dynbatchd.scheduler")


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


class Channel:
    def __init__(self, name: str, settings: Any, window: WindowPolicy, sizer: BatchSizer):
        self.name = name
        self.settings = settings
        self.window = window
        self.sizer = sizer
        self.lanes: dict[Hashable, Lane] = {}
        self.depth = 0
        self.stats = ChannelStats()
        self.cost = CostModel()
        self._rate = 0.0                # dispatched requests per ns, exponentially decayed
        self._rate_at = 0
        self.refused_wait_ns: int | None = None      # the predicted wait of the last refusal
        self._backlogged_since: int | None = None   # more queued than a batch takes, since then
        self._drain_read_at = -self.LAG_REFRESH_NS   # when the drain rate below was read
        self._drain_read = 0.0                       # the drain rate then (admission asks per request)
        self._arrivals = 0.0            # accepted requests per ns, decayed over ARRIVAL_TAU_NS
        self._arrivals_at = 0
        self.mean_tokens = 0.0          # of accepted requests, exponentially weighted
        self.last_window_ns: int | None = None
        self.long_share = LongShare()
        self._probed_ns = -self.PROBE_EVERY_NS   # when `expire` last let a hopeless request try
        self._spared: tuple[int, set[int]] = (0, set())   # (CostModel.disputes episode logged, keys it spared)

    ARRIVAL_TAU_NS = 10_000_000_000   # the offered rate `status` shows follows the last ~10 s

    RATE_TAU_NS = 500_000_000   # the drain rate follows the last ~half second
    LAG_REFRESH_NS = 1_000_000  # how often a backlogged channel re-reads its rates (admission asks per request)

    def arrival_rate(self, now_ns: int) -> float:
        """Accepted requests per ns, recently."""
        return self._arrivals * math.exp(-(now_ns - self._arrivals_at) / self.ARRIVAL_TAU_NS)

    def quiet(self, now_ns: int) -> bool:
        """Nothing queued, and no request accepted for ARRIVAL_TAU_NS (or ever)."""
        return not self.depth and (not self._arrivals or now_ns - self._arrivals_at > self.ARRIVAL_TAU_NS)

    def drain_rate(self, now_ns: int) -> float:
        """Requests dispatched per ns, recently."""
        return self._rate * math.exp(-(now_ns - self._rate_at) / self.RATE_TAU_NS)

    def _drain_wait_ns(self, now_ns: int) -> int:
        """The wait the queue's measured drain rate predicts, once it has been backlogged (more
        queued than a batch takes) for a while: it sees what the cost model cannot, the time
        between a device's batches (hand-over, a daemon or transport slower than the device).
        Under a steady overload admission keeps the accepted rate at the drain rate, so this
        is what keeps admitted requests inside their deadlines: the cost model's device time
        alone undercounts a queue of a second by tens of milliseconds.
        A fresh burst into an idle channel is not judged on it (its past rate means nothing)."""
        since = self._backlogged_since
        if since is None or now_ns - since < self.RATE_TAU_NS:
            return 0
        if now_ns - self._drain_read_at >= self.LAG_REFRESH_NS:   # (the rates move over ~0.5 s)
            self._drain_read_at = now_ns
            self._drain_read = self.drain_rate(now_ns)
        rate = self._drain_read
        return int(self.depth / rate) if rate > 0 else 0

    def backlog_ns(self, up_to_tokens: int | None = None) -> int:
        """Device time the queued requests need, cut in full batches (the learned cost); with
        `up_to_tokens`, only those no longer than that, which a backlog serves first."""
        if not self.depth:
            return 0
        if up_to_tokens is None:
            count, tokens = self.depth, 0
            for lane in self.lanes.values():
                tokens += lane.tokens
        else:
            sizes = [entry[2].tokens for lane in self.lanes.values() for entry in lane.heap
                     if entry[2].tokens <= up_to_tokens]
            count, tokens = len(sizes), sum(sizes)
        base, per_item, per_token = self.cost.coefficients()
        return int(base * -(-count // self.sizer.max_batch()) + per_item * count + per_token * tokens)

    def _lane_key(self, item: Item) -> Hashable:
        """Which lane `item` belongs to: its model, its tenant in an isolated channel, its length
        bucket. In an isolated channel a request of no tenant (``anonymous = "alone"``; the engine
        refuses it otherwise) has a lane of its own, so it runs in a batch of one."""
        settings = self.settings
        tenant = (item.tenant if item.tenant is not None else ("alone", item.key)) if settings.isolated else None
        bucket = bisect.bisect_left(settings.token_buckets, item.tokens) if settings.token_buckets else 0
        return item.model, tenant, bucket, item.warmup

    def lane_for(self, item: Item) -> Lane:
        """The lane of `item` (`_lane_key`), made when it is the first of its kind."""
        key = self._lane_key(item)
        lane = self.lanes.get(key)
        if lane is None:
            lane = self.lanes[key] = Lane(item.model, key[1], bucket=key[2], warmup=item.warmup)
        return lane

    def _forget_empty(self) -> None:
        """Drop empty lanes: a poll walks only lanes with work, however many tenants were ever seen."""
        for key in [key for key, lane in self.lanes.items() if not lane.heap]:
            del self.lanes[key]

    def take_all(self, out: list[Item]) -> None:
        """Empty every lane into `out` (stopping: nothing more may start)."""
        for lane in self.lanes.values():
            while lane.heap:
                out.append(lane.pop())
        self.lanes.clear()
        self.depth = 0

    def offer(self, item: Item, now_ns: int, wait_ns: int | None = None, run_ns: int | None = None) -> bool:
        """Queue `item`; False when the caller should answer `overloaded` at once: the queue is
        full, or `wait_ns` (the predicted wait before it could start; None: no prediction,
        e.g. a device is idle) plus its own run (`run_ns`, else the learned cost of a batch of
        one) would end past its deadline. The refusal is better now than `deadline_exceeded`
        later, after holding a place."""
        if self.depth >= self.settings.queue_limit:
            self.stats.overloaded += 1
            self.refused_wait_ns = None
            return False
        if wait_ns is not None and not self.settings.run_late:
            if run_ns is None:
                run_ns = self.cost.estimate_ns(1, item.tokens)
            if not self.plans_by_size():   # (a planned queue holds requests its plan drops: its length says little)
                wait_ns = max(wait_ns, self._drain_wait_ns(now_ns))
                # Slack of one full batch: admitted at the very edge, a request ends on time by the
                # daemon's clock and late by its client's (the reply's way back, one batch's jitter);
                # under a steady overload admission fills the queue exactly to that edge. (A planned
                # queue is served smallest first, its admission already optimistic: no slack there.)
                limit = self.sizer.max_batch()
                run_ns += self.cost.estimate_ns(limit, int(self.mean_tokens * limit))
            if now_ns + wait_ns + run_ns > item.deadline_ns:
                if not self.cost.disputed:
                    self.stats.overloaded += 1
                    self.refused_wait_ns = wait_ns
                    return False
                self.disputed_refusal(item, run_ns)   # a cost far above what was measured refuses nothing
        if self._backlogged_since is None and self.depth >= self.sizer.max_batch():
            self._backlogged_since = now_ns
        self.lane_for(item).push(item)
        self.depth += 1
        if not item.warmup:
            self.stats.accepted += 1
        self._arrivals = self.arrival_rate(now_ns) + 1 / self.ARRIVAL_TAU_NS
        self._arrivals_at = now_ns
        self.mean_tokens += 0.01 * (item.tokens - self.mean_tokens)
        if self.cost.tokens_matter:   # once tokens are known to cost nothing, no ledger
            _, per_item, per_token = self.cost.coefficients()
            self.long_share.arrived(item.tokens, per_item + per_token * item.tokens)
        self.window.on_arrival(now_ns, item.tokens)
        return True

    def withdraw(self, item: Item) -> Item | None:
        """Take the queued `item` out (its client cancelled it); None when it is not queued
        here (running, answered, or never queued)."""
        lane = self.lanes.get(self._lane_key(item)) if item.queued else None
        if lane is None or not any(entry[2] is item for entry in lane.heap):
            return None
        lane.take([item])
        lane.prune()
        self.depth -= 1
        if not lane.heap:
            self._forget_empty()
        return item

    def requeue(self, item: Item) -> None:
        """Put back an item that was dispatched but not run (its worker died); bypasses the bound."""
        self.lane_for(item).push(item)
        self.depth += 1

    PROBE_EVERY_NS = 250_000_000   # while a device idles, a request the cost calls hopeless is tried this often

    def refuses_on_cost(self, now_ns: int) -> bool:
        """Whether the learned cost may refuse work now (`CostModel.trusted`: settled, and confirmed
        by a measured batch lately). Even then a refusal on a cost that overestimates the recent
        batches by far (`CostModel.disputed`) is not made, but counted and logged (`disputed_refusal`)."""
        return not self.settings.run_late and self.cost.trusted(now_ns)

    def disputed_refusal(self, item: Item, estimate_ns: int) -> None:
        """The disputed cost would have refused `item`: it stays instead; each request counted once,
        each episode (`CostModel.disputes`) logged once."""
        cost = self.cost
        episode, keys = self._spared
        if episode != cost.disputes:   # a new episode: logged once, counted afresh
            keys = set()
            self._spared = (cost.disputes, keys)
            measured = cost.measured_ns(1, item.tokens)
            log.warning("channel %s: its learned cost (%.1f ms for one request) is %.0f times what its last "
                        "batches measured (%.1f ms); it refuses nothing on that cost until the two agree again",
                        self.name, estimate_ns / MS, estimate_ns / max(1, measured), measured / MS)
        if item.key not in keys:
            if len(keys) > 2 * self.settings.queue_limit:   # (only queued ones can be spared twice)
                keys.clear()
            keys.add(item.key)
            self.stats.cost_disputed += 1

    def expire(self, now_ns: int, out: list[Item], device_busy_ns: int = 0, idle: bool = False) -> None:
        """Move requests that can no longer finish in time to `out` (unless run_late): past their
        deadline, or hopeless by a cost the channel may refuse on (`refuses_on_cost`). While a
        device is `idle` and no batch of this channel was measured for PROBE_EVERY_NS, the most
        urgent of those the cost calls hopeless is tried anyway (a circuit breaker's half-open
        state): its batch re-measures the cost."""
        if self.settings.run_late:
            return
        on_cost = self.refuses_on_cost(now_ns)
        confirmed = self.cost.confirmed_ns
        last = max(self._probed_ns, now_ns if confirmed is None else confirmed)
        probe = idle and on_cost and now_ns - last >= self.PROBE_EVERY_NS   # no batch of its own for a while
        start = now_ns + device_busy_ns
        estimate = self.cost.estimate_ns
        emptied = False
        for lane in self.lanes.values():
            while lane.heap:
                deadline, _, head = lane.heap[0]
                if deadline >= now_ns:   # it could still make it: only a cost the channel trusts says otherwise
                    if not on_cost:
                        break
                    run = estimate(1, head.tokens)
                    if deadline >= start + run:
                        break
                    if self.cost.disputed:   # kept, as is every one behind it: count them all
                        for entry in lane.heap:
                            if entry[0] < start + estimate(1, entry[2].tokens):
                                self.disputed_refusal(entry[2], estimate(1, entry[2].tokens))
                        break
                    if probe:
                        probe, self._probed_ns = False, now_ns
                        break
                item = lane.pop()
                out.append(item)
                self.depth -= 1
                if not item.warmup:
                    self.stats.expired += 1
            lane.prune()
            emptied = emptied or not lane.heap
        if emptied:
            self._forget_empty()

    def expires_at(self, lane: Lane, now_ns: int) -> int:
        """The first instant `expire` would answer this lane's head: when even a batch of one would
        end too late, by a cost the channel may refuse on; else (or already past that, yet kept:
        a probe, a disputed cost) at its deadline."""
        deadline = lane.head_deadline()
        if not self.refuses_on_cost(now_ns):
            return deadline + 1
        at = deadline - self.cost.estimate_ns(1) + 1
        return at if at > now_ns else deadline + 1

    def lane_state(self, lane: Lane, free_slots: int, busy_ns: int = 0) -> LaneState:
        return LaneState(len(lane), lane.tokens, self.sizer.max_batch(), lane.opened_ns,
                         lane.head_deadline(), free_slots, self.cost, busy_ns)

    def ready_at(self, lane: Lane, now_ns: int, free_slots: int, draining: bool, busy_ns: int = 0) -> int:
        """When this lane's next batch may be cut: `now_ns` or earlier means now."""
        if not lane.heap:
            return NEVER
        limit = self.sizer.max_batch()
        cap = self.settings.max_tokens
        if draining or len(lane) >= limit or (cap and lane.tokens >= cap):
            return now_ns
        state = self.lane_state(lane, free_slots, busy_ns)
        # window_ms bounds every policy: the compliance rules and the operator's SLO rely on it.
        window = min(self.window.window_ns(now_ns, state), int(self.settings.window_ms * MS))
        self.last_window_ns = window   # for status only: policies answer without remembering
        window_end = lane.opened_ns + window
        # Close early when waiting longer would make the most urgent request miss.
        urgent = lane.head_deadline() - self.cost.estimate_ns(min(len(lane), limit), lane.tokens)
        return min(window_end, urgent)

    def form(self, lane: Lane, batch_id: int, now_ns: int, start_ns: int | None = None,
             budget_ns: int | None = None) -> Batch:
        """Cut a batch from `lane` that will start at `start_ns` (default now).

        Where request sizes matter (`_sizes_matter`), the first batch of a plan
        of the queue that gets the most requests done in time (`_planned_first`:
        deadline order, full batches, the largest request dropped from the plan
        while its last batch would be late). Otherwise earliest deadline first,
        up to the size and token caps. A batch
        never runs longer than `budget_ns` (by the learned cost) but for its first request:
        what a channel of higher priority can wait for.
        """
        limit = self.sizer.max_batch()
        cap = self.settings.max_tokens
        start = now_ns if start_ns is None else start_ns
        picked = None
        if len(lane) > 1 and not self.settings.run_late and not lane.heap[0][2].retries and self._sizes_matter(lane):
            picked = self._planned_first(lane, start, limit, cap, self.long_share.owed(), budget_ns)
        if picked:
            items = lane.take(picked)
            tokens = sum(item.tokens for item in items)
            _, per_item, per_token = self.cost.coefficients()
            self.long_share.served([i.tokens for i in items], [per_item + per_token * i.tokens for i in items])
        else:
            items, tokens = [], 0
            estimate = self.cost.estimate_ns
            while lane.heap and len(items) < limit:
                nxt = lane.heap[0][2]
                if items and ((cap and tokens + nxt.tokens > cap) or nxt.retries or items[0].retries):
                    break   # a request whose worker died under it runs alone: one poison input kills only itself
                if items and budget_ns is not None and estimate(len(items) + 1, tokens + nxt.tokens) > budget_ns:
                    break
                items.append(lane.pop())
                tokens += nxt.tokens
        lane.prune()
        if not lane.heap:
            self._forget_empty()
        self.depth -= len(items)
        self._rate = self.drain_rate(now_ns) + len(items) / self.RATE_TAU_NS
        self._rate_at = now_ns
        if self.depth < limit:   # what is left fits one batch: not backlogged
            self._backlogged_since = None
        stats = self.stats
        if lane.warmup:   # optional work: it must not flatter or spoil the live fill figures
            stats.warmup_batches += 1
            stats.warmup_items += len(items)
        else:
            stats.batches += 1
            stats.batched_items += len(items)
            stats.batch_sizes[len(items)] = stats.batch_sizes.get(len(items), 0) + 1
            stats.fill_sum += len(items) / limit
            for item in items:
                stats.wait_ns += now_ns - item.arrival_ns
        return Batch(batch_id, self.name, lane.model, items, now_ns, limit, tokens)

    def _tokens_outweigh(self, mean_tokens: float) -> bool:
        """Whether a request of `mean_tokens` costs more device time by its tokens than by itself
        (else, e.g. for a no-op model, planning by size would cost more than it saves)."""
        _, per_item, per_token = self.cost.coefficients()
        return per_token * mean_tokens > per_item

    def plans_by_size(self) -> bool:
        """Whether this channel's batches are planned by request size (`_planned_first`), by the
        mean request it has accepted."""
        return self._tokens_outweigh(self.mean_tokens)

    def _sizes_matter(self, lane: Lane) -> bool:
        """Whether planning `lane` by size can pay, by its mean queued request."""
        return self._tokens_outweigh(lane.tokens / len(lane))

    PLAN_BATCHES = 8   # how many batches ahead `_planned_first` plans (the rest of a long queue waits its turn)

    def _planned_first(self, lane: Lane, start: int, limit: int, cap: int, long_first: bool = False,
                       budget_ns: int | None = None) -> list[Item]:
        """The first batch of a plan that gets the most requests done in time (Moore and Hodgson's
        rule, for batches): take the queue in deadline order, cut it into full batches run one
        after another from `start` (by the learned cost); whenever the last planned batch would
        end past the earliest deadline in it, drop the largest request planned so far (it costs
        the most device time, so dropping it saves the most for the others) and plan on. The
        batch to run now is the plan's first. A dropped request is not refused: it waits, and a
        later plan may still fit it, or `expire` answers it. While long requests are owed their
        floor of device time (`long_first`, `LongShare`), a short request is dropped before any
        long one. Requests that cannot make it even alone are left for `expire`; a retried
        request is never planned (it runs alone)."""
        base, per_item, per_token = self.cost.coefficients()
        is_long = self.long_share.is_long
        kept: list[Item] = []
        tokens = 0
        for deadline, _, item in heapq.nsmallest(self.PLAN_BATCHES * limit, lane.heap):
            if item.retries or start + base + per_item + per_token * item.tokens > deadline:
                continue
            kept.append(item)
            tokens += item.tokens
            while kept:   # (never emptied: a request feasible alone, or the plan before it, fits)
                count = len(kept)
                batches = -(-count // limit)
                end = start + base * batches + per_item * count + per_token * tokens
                if end <= kept[(batches - 1) * limit].deadline_ns:
                    break
                drop = max(range(count), key=(lambda i: (not is_long(kept[i].tokens), kept[i].tokens)) if long_first
                           else (lambda i: kept[i].tokens))
                tokens -= kept.pop(drop).tokens
        chosen: list[Item] = []
        tokens = 0
        for item in kept:   # the first batch, within the token cap and the time budget
            if len(chosen) == limit or (cap and tokens + item.tokens > cap):
                break
            if chosen and budget_ns is not None and self.cost.estimate_ns(len(chosen) + 1, tokens + item.tokens) > budget_ns:
                break
            chosen.append(item)
            tokens += item.tokens
        return chosen

    def retune(self, settings: Any, fresh: "Channel") -> None:
        """Adopt new settings (tune, reload) with the policies `fresh` was built with; a policy
        whose selection (name and options) did not change inherits what the old one learned."""
        if settings == self.settings:
            return
        old = self.settings
        for attr, key in (("window", "window"), ("sizer", "batch_size")):
            current, new = getattr(self, attr), getattr(fresh, attr)
            if getattr(old, key, None) == getattr(settings, key, None) and type(current) is type(new) \
                    and hasattr(new, "inherit"):
                new.inherit(current)
            setattr(self, attr, new)
        self.settings = settings
        if old.isolated != settings.isolated and self.depth:   # lanes key by tenant only when isolated
            queued: list[Item] = []
            self.take_all(queued)
            for item in queued:
                self.requeue(item)

    def describe(self) -> dict[str, Any]:
        policy = self.window.describe()
        if not isinstance(policy.get("window_ms"), (int, float)) and self.last_window_ns is not None:
            policy["window_ms"] = self.last_window_ns / MS   # the window last decided, where it depends on the lane
        return {**policy, "sizer": self.sizer.describe()}

    def snapshot(self, now_ns: int) -> dict[str, Any]:
        """Stats plus what a planner needs: offered rate, request size, learned batch cost."""
        base, per_item, per_token = self.cost.coefficients()
        return {**self.stats.snapshot(self.depth, self.sizer.max_batch(), self.describe()),
                "arrival_rps": round(self.arrival_rate(now_ns) * 1e9, 3),
                "mean_tokens": round(self.mean_tokens, 1),
                "cost_ms": {"base": base / 1e6, "per_item": per_item / 1e6, "per_token": per_token / 1e6,
                            "samples": self.cost.samples}}
