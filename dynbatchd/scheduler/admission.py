"""A channel's admission and refusal: `offer` queues a request or refuses it (queue room, the
cost model's predicted wait), `withdraw`/`requeue` take one out or back, `expire` answers the
requests that can no longer make their deadline. A base of `Channel`, kept apart so the queue's
bookkeeping and its planner read without the admission rules in between.
"""

from __future__ import annotations

import logging

from dynbatchd.scheduler.policies import MS
from dynbatchd.scheduler.lanes import Item, Lane

log = logging.getLogger("dynbatchd.scheduler")


class Admission:
    """`Channel`'s admission and expiry; the state it reads is set in `Channel.__init__`."""

    def offer(self, item: Item, now_ns: int, wait_ns: int | None = None, run_ns: int | None = None) -> bool:
        """Queue `item`; False when the caller should answer `overloaded` at once: the queue is
        full, or `wait_ns` (the predicted wait before it could start; None: no prediction,
        e.g. a device is idle) plus its own run (`run_ns`, else the learned cost of a batch of
        one) would end past its deadline. The refusal is better now than `deadline_exceeded`
        later, after holding a place."""
        if self.depth >= self.settings.queue_limit:
            self.stats.overloaded += 1
            self.counted_outcomes(1, 1, now_ns)
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
                    self.counted_outcomes(1, 1, now_ns)
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
        self.arrival_gaps.arrived(now_ns, item.tokens)
        self.mean_tokens += 0.01 * (item.tokens - self.mean_tokens)
        if self.cost.tokens_matter:   # once tokens are known to cost nothing: no ledger, no plan to size
            base, per_item, per_token = self.cost.coefficients()
            own = per_item + per_token * item.tokens
            limit = self.sizer.max_batch()
            ledger = self.long_ledger
            ledger.batch_ns, ledger.max_batch = base, limit
            ledger.stretch = self.device_stretch   # the shadow FIFO gets the device time this channel does
            ledger.share = self.settings.long_share
            ledger.arrived(item.tokens, own, now_ns, item.deadline_ns)
            self.median_tokens.add(item.tokens)
            self._load = self.arrival_load(now_ns) + (own + base / limit) / (self.settings.deadline_ms * MS)
            self._load_at = now_ns
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
        on_cost = probe = None   # (asked only of a head the cost calls hopeless: most polls meet none)
        start = now_ns + device_busy_ns
        estimate = self.cost.estimate_ns
        emptied = False
        for lane in self.lanes.values():
            while lane.heap:
                deadline, _, head = lane.heap[0]
                if deadline >= now_ns:   # it could still make it: only a cost the channel trusts says otherwise
                    run = estimate(1, head.tokens)
                    if deadline >= start + run:
                        break
                    if on_cost is None:
                        on_cost = self.refuses_on_cost(now_ns)
                        confirmed = self.cost.confirmed_ns
                        last = max(self._probed_ns, now_ns if confirmed is None else confirmed)
                        probe = idle and on_cost and now_ns - last >= self.PROBE_EVERY_NS   # no batch of its own for a while
                    if not on_cost:
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
                    self.counted_outcomes(1, 1, now_ns)
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
