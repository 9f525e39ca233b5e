"""Keeping long requests from starving when short ones are cheaper to serve.

Under a backlog a channel plans its queue and drops the largest requests from
the plan first (the most requests on time per unit of device time). Left
alone, that could serve a request of 10k tokens never while short ones keep
coming. This ledger keeps, per channel, the device time the longest tenth of
requests (by tokens, a running estimate of the 90th percentile) asked for and
the device time they got, both decayed over the last ~`memory` requests; while
they got less than `floor` of their share, the plan drops short requests
before long ones (`Channel._planned_first`).
The memory is ~3000 requests (seconds of a burst): long requests served while
the device kept up count toward the floor a burst later, so a burst does not
owe for device time they already had.
"""

from __future__ import annotations


class LongShare:
    QUANTILE = 0.9

    def __init__(self, floor: float = 0.2, memory: int = 3000):
        self.floor = floor
        self.decay = 1.0 - 1.0 / memory
        self.cut = 0.0           # running estimate of the tokens 90th percentile
        self.asked = [0.0, 0.0]  # device time asked (short, long), decayed per arrival
        self.got = [0.0, 0.0]    # device time given (short, long), decayed per batch item

    def is_long(self, tokens: int) -> bool:
        """Above the running 90th percentile, by a margin (so requests all of one size are not)."""
        return tokens > 1.05 * self.cut + 1

    def arrived(self, tokens: int, cost_ns: float) -> None:
        if not any(self.asked) and not self.cut:
            self.cut = float(tokens)        # start the estimate at the first request seen
        step = max(1.0, 0.02 * self.cut)   # stochastic approximation of the quantile
        self.cut = max(0.0, self.cut + step * (self.QUANTILE - (tokens <= self.cut)))
        self.asked[0] *= self.decay
        self.asked[1] *= self.decay
        self.asked[self.is_long(tokens)] += cost_ns

    def served(self, tokens: list[int], cost_ns: list[float]) -> None:
        for t, c in zip(tokens, cost_ns):
            self.got[0] *= self.decay
            self.got[1] *= self.decay
            self.got[self.is_long(t)] += c

    def owed(self) -> bool:
        """Whether long requests got less than `floor` of the device-time share they asked for."""
        asked, got = sum(self.asked), sum(self.got)
        if asked <= 0 or got <= 0 or self.asked[1] <= 0:
            return False
        return self.got[1] / got < self.floor * self.asked[1] / asked
