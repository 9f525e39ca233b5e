"""A running quantile of request sizes, in O(1) a request and no memory of them.

A stochastic approximation: the estimate moves up by `quantile` of a step when a request is
above it and down by the rest when not, so it settles where `quantile` of requests are at or
below it. Each step is 2% of the estimate (at least one token): it follows a drifting mix over
a few hundred requests, and a scale of a hundred tokens or a hundred thousand alike.
"""

from __future__ import annotations


class RunningQuantile:
    STEP_SHARE = 0.02

    def __init__(self, quantile: float):
        self.quantile = quantile
        self.value = 0.0
        self.seen = False

    def add(self, x: float) -> None:
        if not self.seen:
            self.seen, self.value = True, float(x)   # start at the first request seen
        step = max(1.0, self.STEP_SHARE * self.value)
        self.value = max(0.0, self.value + step * (self.quantile - (x <= self.value)))
