"""Keeping long requests from starving when short ones are cheaper to serve.

Under a backlog a channel plans its queue and drops the largest requests from
the plan first (the most requests on time per unit of device time). Left
alone, that serves the longest requests (by tokens, above a running estimate
of the 90th percentile) far less than first-come first-served would: a burst
of long requests at low mean load got under half of FIFO's share of them.
This ledger runs a *shadow FIFO* beside the channel (FIFO that drops the
hopeless, `benchmarks.heuristics.fifo_drop_hopeless`, online, on the learned
cost) and counts the long requests it would have served against those the
plan served, both decayed over the last ~`memory` arrivals. While the plan
served fewer than the channel's ``long_share`` of FIFO's, long requests are
owed, and their `price` rises; while they are not, it falls back towards 0.
The plan drops the request of the most device time per unit of worth, a long
one worth 1 + `price` (`Channel._planned_first`): a Lagrange multiplier on the
share, found by dual ascent. What it displaces is the cheapest way to the share:
the requests just under the long cut, not every short one beside a long one
(guarding one long request a plan, the rule before, cost four to five times as
many requests on the code-completion trace for the same share; docs/benchmarks.md).
The shadow FIFO runs on the device time the channel gets: where channels of
higher priority took a share of it lately, its work takes that much longer.
Owed only what FIFO would have served: under an overload in which FIFO would
not have served them either (the Azure trace at x80) short requests are not
held back, which a floor of device time did at a cost of ~50 requests on time.
"""

from __future__ import annotations

from collections import deque

from dynbatchd.scheduler.quantile import RunningQuantile


class LongShare:
    QUANTILE = 0.9

    def __init__(self, memory: int = 3000):
        self.decay = 1.0 - 1.0 / memory
        self._cut = RunningQuantile(self.QUANTILE)   # of requests' tokens
        self.fifo_queue: deque = deque()   # the shadow FIFO's queue: (arrival, deadline, work, long)
        self.fifo_free = 0       # when the shadow FIFO's device is next free
        self.batch_ns = 0.0      # a batch's fixed cost, ns (learned: set by the channel)
        self.max_batch = 32
        self.stretch = 1.0       # the channel's device time to wall time (channels above take a share)
        self.fifo_long = 0.0     # long requests the shadow FIFO served, decayed per arrival
        self.done_long = 0.0     # long requests the plan served, decayed per arrival
        self.share = self.FIFO_SHARE   # of FIFO's long requests the plan owes (the channel's long_share)
        self.price = 0.0         # what a long request is worth beyond one request to the plan
        self.price_step = 1.0 / memory   # per arrival: the price moves by 1 at most over the ledger's memory

    @property
    def cut(self) -> float:
        """The running estimate of the requests' tokens 90th percentile."""
        return self._cut.value

    @cut.setter
    def cut(self, tokens: float) -> None:
        self._cut.value, self._cut.seen = float(tokens), True

    def long_above(self) -> float:
        """The size a long request exceeds: the running 90th percentile, by a margin (so requests
        all of one size are not long)."""
        return 1.05 * self._cut.value + 1

    def is_long(self, tokens: int) -> bool:
        """Above `long_above`."""
        return tokens > self.long_above()

    FIFO_SHARE = 0.9   # the default of a channel's ``long_share`` (dynbatchd.config.schema.ChannelSettings)

    def arrived(self, tokens: int, cost_ns: float, now_ns: int | None = None, deadline_ns: int | None = None) -> None:
        """Count a request in; with its arrival and deadline, the shadow FIFO sees it too
        (`batch_ns`, `max_batch`: the channel's). The `price` of a long request then steps up
        while long requests are owed and down while not (never under 0)."""
        self._cut.add(tokens)
        self.fifo_long *= self.decay
        self.done_long *= self.decay
        if now_ns is not None and deadline_ns is not None:
            self._fifo_run(now_ns)
            self.fifo_queue.append((now_ns, deadline_ns, cost_ns * self.stretch, self.is_long(tokens)))
        step = self.price_step if self.owed(self.share) else -self.price_step
        self.price = max(0.0, self.price + step)

    def _fifo_run(self, now_ns: int) -> None:
        """Run the shadow FIFO up to `now_ns`: whenever its device is free, drop the queued requests
        that could not finish in time even alone, take the oldest up to a full batch and shrink it
        until its oldest finishes in time (`benchmarks.heuristics.fifo_drop_hopeless`, online)."""
        q, base = self.fifo_queue, self.batch_ns * self.stretch
        while q:
            start = max(self.fifo_free, q[0][0])
            if start > now_ns:
                return
            while q and start + base + q[0][2] > q[0][1]:
                q.popleft()
            if not q:
                return
            work, n = 0.0, 0
            while n < min(len(q), self.max_batch) and start + base + work + q[n][2] <= q[0][1]:
                work += q[n][2]
                n += 1
            for _ in range(n):
                self.fifo_long += q.popleft()[3]
            self.fifo_free = start + base + work

    def served(self, tokens: list[int]) -> None:
        """Count a batch the plan runs (its requests are planned to finish in time)."""
        for t in tokens:
            self.done_long += self.is_long(t)

    def owed(self, share: float = FIFO_SHARE) -> bool:
        """Whether the plan served fewer long requests, lately, than `share` of those the shadow
        FIFO would have served (the channel's ``long_share``; 0: never owed, the rule is off)."""
        return share > 0 and self.done_long < share * self.fifo_long

