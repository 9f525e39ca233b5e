"""When the next request of a channel is likely to come: the gaps between its arrivals, lately.

A device cannot be preempted. A lower channel's request that alone runs longer than a realtime
request can wait makes every realtime request arriving early in its run late, whenever it starts;
what the scheduler can choose is when. Where arrivals come at random (Poisson) every moment is as
risky as any other and waiting gains nothing. Where they come in steps (a client's periodic
flush, a trace whose requests arrive every 3 s in groups), the moments just before a step are
risky and those just after it are safe. `ArrivalGaps` keeps the recent gaps between a channel's
arrival instants and says how likely a request is to arrive within a window that starts some
time after the last one (`chance`), and the earliest start, within a request's slack, at which
that chance is markedly lower than now (`safer_start`).
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

    ONE_INSTANT_NS = 2_000_000   # arrivals closer than this came together (one step, sent back to back)

    def arrived(self, now_ns: int) -> None:
        """Count an arrival at `now_ns`. Arrivals closer than ONE_INSTANT_NS to the last are one
        instant with it: a step's requests reach the daemon spread over a millisecond or so, and
        those gaps read as "the next one comes at once". (Those of a step that come while a batch
        above runs are held by `Scheduler._waiting_above`.)"""
        if self.last_ns is not None and now_ns - self.last_ns >= self.ONE_INSTANT_NS:
            self._gaps.append(now_ns - self.last_ns)
        if self.last_ns is None or now_ns > self.last_ns:
            self.last_ns = now_ns

    def chance(self, quiet_ns: int, width_ns: int, gaps: list[int] | None = None) -> tuple[float, float] | None:
        """How likely the next arrival is to come within `width_ns` after `quiet_ns` with none: of
        the recent gaps longer than `quiet_ns`, the share no longer than `quiet_ns + width_ns`, as
        a (low, high) Wilson interval (`Z`). None: too few such gaps to say."""
        gaps = sorted(self._gaps) if gaps is None else gaps
        past = bisect.bisect_right(gaps, quiet_ns)
        longer = len(gaps) - past
        if longer < self.LEAST_SEEN:
            return None
        return _wilson(bisect.bisect_right(gaps, quiet_ns + width_ns) - past, longer, self.Z)

    def safer_start(self, now_ns: int, width_ns: int, latest_ns: int) -> int:
        """The earliest start at or after `now_ns`, and no later than `latest_ns`, of a run that a
        request arriving in its first `width_ns` would miss its deadline behind: now, unless at a
        later moment, just past a usual gap, one is surely less likely: the high end of its
        chance at most `SAFER` of the low end of now's. There, either a request came at that gap and
        the next gap starts afresh, or none did and the quiet goes on: the chance is the larger of
        the two. Random (Poisson) arrivals have no such moment: waiting for one gains nothing."""
        if self.last_ns is None or width_ns <= 0 or latest_ns <= now_ns or len(self._gaps) < self.LEAST_SEEN:
            return now_ns
        gaps = sorted(self._gaps)
        quiet = now_ns - self.last_ns
        now_chance = self.chance(quiet, width_ns, gaps)
        if now_chance is None or not now_chance[0]:
            return now_ns
        bar = self.SAFER * now_chance[0]
        afresh = _wilson(bisect.bisect_right(gaps, width_ns), len(gaps), self.Z)[1]
        if afresh > bar:
            return now_ns
        tried = None
        for gap in gaps[bisect.bisect_right(gaps, quiet):]:   # just past each usual gap, in turn
            at = self.last_ns + gap + 1
            if at > latest_ns:
                break
            if gap == tried:
                continue
            tried, later = gap, self.chance(gap + 1, width_ns, gaps)
            if later is None or later[1] <= bar:
                return at
        return now_ns


def _wilson(hits: int, n: int, z: float) -> tuple[float, float]:
    """The Wilson score interval of a share `hits` / `n` (n > 0) at `z` standard deviations."""
    p, zz = hits / n, z * z / n
    centre = (p + zz / 2) / (1 + zz)
    half = z * math.sqrt(p * (1 - p) / n + zz / (4 * n)) / (1 + zz)
    return max(0.0, centre - half), min(1.0, centre + half)
