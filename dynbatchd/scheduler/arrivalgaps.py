"""When the next request of a channel is likely to come: the gaps between its arrivals, lately.

A device cannot be preempted. A lower channel's request that runs longer than a realtime request
can wait (alone, or after what the device still runs) makes every realtime request arriving early
in its run late, whenever it starts; what the scheduler can choose is when. Where arrivals come at
random (Poisson) every moment is as risky as any other and waiting gains nothing. Where they come in steps (a client's periodic
flush, a trace whose requests arrive every 3 s in groups), the moments just before a step are
risky and those just after it are safe. `ArrivalGaps` keeps the recent gaps between a channel's
arrival instants and says the earliest start, within a request's slack, at which a request is
markedly less likely to arrive early in its run than now (`safer_start`), and how much usually
arrives at one instant (`usual_instant`). The scheduler keeps one more over the instants
requests of any channel arrive at: once a channel has been quiet longer than nearly all its own
gaps, those cannot say, and the traffic's steps still can.
"""

from __future__ import annotations

import bisect
import math
from collections import deque


class ArrivalGaps:
    MEMORY = 256      # gaps kept (the last ones)
    LEAST_SEEN = 16   # gaps longer than the quiet so far needed to say anything
    SAFER = 0.5       # a later start is taken where its chance is at most this part of now's
    Z = 2.0           # the chances compared are sure to this many standard deviations

    def __init__(self) -> None:
        self._gaps: deque[int] = deque(maxlen=self.MEMORY)
        self.last_ns: int | None = None
        self._count = self._tokens = 0   # the requests of the instant now open, and their tokens
        self._counts: deque[int] = deque(maxlen=self.MEMORY)   # of the instants closed since
        self._token_sums: deque[int] = deque(maxlen=self.MEMORY)
        self._usual: tuple[int, int] | None = None   # `usual_instant`, until the next instant closes

    USUAL_INSTANT = 0.9   # the quantile of what arrives at one instant that `usual_instant` says

    ONE_INSTANT_NS = 2_000_000   # arrivals closer than this came together (one step, sent back to back)

    def arrived(self, now_ns: int, tokens: int = 0) -> None:
        """Count an arrival at `now_ns` of `tokens`. Arrivals closer than ONE_INSTANT_NS to the
        last are one instant with it: a step's requests reach the daemon spread over a millisecond
        or so, and those gaps read as "the next one comes at once". (Those of a step that come
        while a batch above runs are held by `Scheduler._waiting_above`.)"""
        if self.last_ns is not None and now_ns - self.last_ns >= self.ONE_INSTANT_NS:
            self._gaps.append(now_ns - self.last_ns)
            self._counts.append(self._count)
            self._token_sums.append(self._tokens)
            self._count = self._tokens = 0
            self._usual = None
        self._count += 1
        self._tokens += tokens
        if self.last_ns is None or now_ns > self.last_ns:
            self.last_ns = now_ns

    def usual_instant(self) -> tuple[int, int]:
        """What arrives at one instant, requests and their tokens, at the USUAL_INSTANT quantile:
        a step brings several requests at once, and all of them must run in time. Exact over the
        last MEMORY instants (a running estimate trailed the first minute's steps by half), worked
        out once an instant closes, when first asked. (0, 0) before one has closed."""
        if self._usual is None and self._counts:
            at = int(self.USUAL_INSTANT * (len(self._counts) - 1) + 0.5)
            self._usual = sorted(self._counts)[at], sorted(self._token_sums)[at]
        return self._usual or (0, 0)

    def safer_start(self, now_ns: int, width_ns: int, latest_ns: int) -> int | None:
        """The earliest start at or after `now_ns`, and no later than `latest_ns`, of a run that a
        request arriving in its first `width_ns` would miss its deadline behind: now, unless at a
        later moment, just past a usual gap, one is surely less likely: the high end of its
        chance at most `SAFER` of the low end of now's. Gaps within ONE_INSTANT_NS of each other
        are one usual gap (live, a step comes a fraction of a millisecond early or late), and
        "just past" it is past the longest of them. There, either the next request came before the
        run starts, and the one after comes within `width_ns` (and an instant's spread) as any gap
        is that short, or it comes within the run's first `width_ns` (of the gaps longer than the
        quiet so far, the share that end there): the chance is the larger of the two. Random
        (Poisson) arrivals have no such moment: waiting for one gains nothing.
        None: the gaps cannot say (too few of them, or too few longer than the quiet so far)."""
        if width_ns <= 0 or latest_ns <= now_ns:
            return now_ns
        if self.last_ns is None or len(self._gaps) < self.LEAST_SEEN:
            return None
        gaps = sorted(self._gaps)
        quiet = now_ns - self.last_ns
        past = bisect.bisect_right(gaps, quiet)
        longer = len(gaps) - past
        if longer < self.LEAST_SEEN:
            return None

        def next_within(after: int) -> tuple[float, float]:   # the next arrival comes in (after, after + width]
            return _wilson(bisect.bisect_right(gaps, after + width_ns) - bisect.bisect_right(gaps, after), longer, self.Z)

        bar = self.SAFER * next_within(quiet)[0]
        afresh = _wilson(bisect.bisect_right(gaps, width_ns + self.ONE_INSTANT_NS), len(gaps), self.Z)[1]
        k = past
        while afresh <= bar and k < len(gaps):   # just past each usual gap, in turn
            usual = gaps[bisect.bisect_right(gaps, gaps[k] + self.ONE_INSTANT_NS) - 1]
            at = self.last_ns + usual + 1
            if at > latest_ns:
                break
            if next_within(usual)[1] <= bar:
                return at
            k = bisect.bisect_right(gaps, usual)
        return now_ns


def _wilson(hits: int, n: int, z: float) -> tuple[float, float]:
    """The Wilson score interval of a share `hits` / `n` (n > 0) at `z` standard deviations."""
    p, zz = hits / n, z * z / n
    centre = (p + zz / 2) / (1 + zz)
    half = z * math.sqrt(p * (1 - p) / n + zz / (4 * n)) / (1 + zz)
    return max(0.0, centre - half), min(1.0, centre + half)
