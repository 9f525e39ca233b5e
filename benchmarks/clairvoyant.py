"""A witness from below: a real schedule of a whole trace, made knowing every arrival ahead.

`benchmarks.bound` says what no schedule can beat, by a fluid relaxation. This builds one
schedule that a device could run (whole requests, batches that are not split, no preemption), so
the optimum lies between the two. It is offline: it sees the bursts coming, which no online rule
(dynbatchd's, the planner's) can, so it says how much of the room to the bound is worth chasing.

The schedule: the served requests in arrival order, a batch started whenever the device is idle
with every served request that has arrived (up to `max_batch`). Moore and Hodgson's rule builds the
set: serve all (or a set given, such as what the online planner got on time); at the first late
batch, drop from its busy period the request of most device time per worth, and replay. Then each
dropped request, most worth per device time first, is put back where every batch stays on time, or
swapped in for a costlier one. With one relative deadline, arrival and deadline orders agree, the
case where that rule is strongest. Not the optimum: a witness that it is at least this.
"""

from __future__ import annotations

import argparse
from bisect import bisect_right
from typing import Sequence

from dynbatchd.simulate import Arrival, DeviceModel, read_trace_csv

from benchmarks.bound import most_on_time
from benchmarks.heuristics import edf_plan_drop_largest, fifo_drop_hopeless
from benchmarks.traces import add_replay_options, sped_up, start_replay

MS = 1_000_000


class _Trace:
    """A trace in arrival order, with what the schedule needs of each request."""

    def __init__(self, arrivals: Sequence[Arrival], device: DeviceModel, deadline_ms: float, max_batch: int):
        self.order = sorted(range(len(arrivals)), key=lambda i: arrivals[i].at_ns)
        self.at = [arrivals[i].at_ns for i in self.order]
        self.cost = [(device.per_item_ms + device.per_token_ms * arrivals[i].tokens) * MS for i in self.order]
        self.base = device.base_ms * MS
        self.deadline = deadline_ms * MS
        self.max_batch = max_batch

    def batches(self, served: list[bool], lo: int = 0, free: float = 0.0, idle_at_lo: bool = False):
        """The greedy schedule of the `served` requests from index `lo`, the device free from
        `free` (idle then if `idle_at_lo`): yields (start, first index, next index, end, whether
        the device was idle at start)."""
        at, cost, n = self.at, self.cost, len(self.at)
        now, k = free, lo
        while k < n:
            if not served[k]:
                k += 1
                continue
            idle = at[k] > now or (idle_at_lo and k == lo)
            if idle:
                now = at[k]
            j, count, work = k, 0, 0.0
            while j < n and count < self.max_batch:
                if served[j]:
                    if at[j] > now:
                        break
                    count += 1
                    work += cost[j]
                j += 1
            end = now + self.base + work
            yield now, k, j, end, idle
            now, k = end, j

    def first_late(self, served: list[bool], resume: tuple | None = None, settled_after: int | None = None):
        """The first late batch, replaying from the start or from `resume` (a batch earlier
        returned, its period's first index and batches before it): (the busy period's first
        index, the late batch's next index, the period's batches as (start, first index, idle)),
        or None. With `settled_after`, replay from the idle start at or before it and stop at the
        first idle start past it: from there the schedule is the one already checked."""
        period, started = 0, []
        lo, free, idle_at_lo = 0, 0.0, False
        if resume is not None:
            period, started, (free, lo, idle_at_lo) = resume[0], list(resume[1]), resume[2]
        for start, first, nxt, end, idle in self.batches(served, lo, free, idle_at_lo):
            if idle:
                if settled_after is not None and first > settled_after and first != lo:
                    return None
                period, started = first, []
            started.append((start, first, idle))
            if end > self.at[first] + self.deadline:
                return period, nxt, started
        return None

    def idle_starts(self, served: list[bool]) -> list[int]:
        return [first for _, first, _, _, idle in self.batches(served) if idle]


def witness(arrivals: Sequence[Arrival], device: DeviceModel, deadline_ms: float, max_batch: int = 32,
            worth: Sequence[float] | None = None, start: Sequence[bool] | None = None, passes: int = 1) -> list[bool]:
    """Which requests (per arrival, in the order given) the clairvoyant schedule serves on time,
    aiming at the most total `worth` (default: 1 a request); from the requests `start` marks
    (default: all), with `passes` rounds of putting dropped requests back."""
    trace = _Trace(arrivals, device, deadline_ms, max_batch)
    value = [1.0 if worth is None else worth[i] for i in trace.order]
    served = [trace.base + trace.cost[k] <= trace.deadline and value[k] > 0 and (start is None or start[i])
              for k, i in enumerate(trace.order)]
    _drop_until_on_time(trace, served, value)
    _put_back(trace, served, value, passes)
    _drop_until_on_time(trace, served, value)   # (put-backs were checked near each change: this checks all)
    on_time = [False] * len(served)
    for k, i in enumerate(trace.order):
        on_time[i] = served[k]
    return on_time


def _drop_until_on_time(trace: _Trace, served: list[bool], value: list[float]) -> None:
    """Moore and Hodgson's rule: at the first late batch, drop from its busy period the request of
    most device time per worth; replay from the batch that held it; until none is late."""
    resume = None
    while (late := trace.first_late(served, resume)) is not None:
        period, nxt, started = late
        drop = max((k for k in range(period, nxt) if served[k]), key=lambda k: trace.cost[k] / value[k])
        served[drop] = False
        held = max(b for b, (_, first, _) in enumerate(started) if first <= drop)
        resume = (period, started[:held], started[held])   # the batches before it are unchanged


def _put_back(trace: _Trace, served: list[bool], value: list[float], passes: int) -> None:
    """Each dropped request, most worth per device time first, back in where every batch stays on
    time; else in for the served request near it of most device time, if that one is worth no
    more and costs more (nothing lost, room gained). Up to `passes` rounds, while any changes."""
    idle = trace.idle_starts(served)

    def replay_near(changed: list[int], settle: bool):
        before = bisect_right(idle, min(changed)) - 1
        lo = idle[before] if before >= 0 else min(changed)
        return trace.first_late(served, (lo, [], (0.0, lo, True)), settled_after=max(changed) if settle else None)

    for _ in range(passes):
        changes = 0
        dropped = [k for k in range(len(served)) if not served[k] and value[k] > 0
                   and trace.base + trace.cost[k] <= trace.deadline]
        for k in sorted(dropped, key=lambda k: -value[k] / trace.cost[k]):
            served[k] = True
            late = replay_near([k], settle=True)
            if late is not None:
                late = replay_near([k], settle=False)   # (the same first late batch, and its period)
                period, nxt, _ = late
                out = max((j for j in range(period, nxt) if served[j] and j != k), default=None,
                          key=lambda j: trace.cost[j] / value[j])
                if out is None or value[out] > value[k] or trace.cost[out] <= trace.cost[k]:
                    served[k] = False
                    continue
                served[out] = False
                if replay_near([k, out], settle=True) is not None:
                    served[k], served[out] = False, True
                    continue
            idle, changes = trace.idle_starts(served), changes + 1
        if not changes:
            return


def witness_with_floor(arrivals: Sequence[Arrival], device: DeviceModel, deadline_ms: float, longest: Sequence[int],
                       floor: float, max_batch: int = 32, starts: Sequence[Sequence[bool] | None] = (None,),
                       passes: int = 2) -> list[bool]:
    """The clairvoyant schedule of the most requests that serves at least `floor` of the requests
    `longest` on time, from each of `starts`: a long request is worth 1 + p, p by bisection to
    the least that meets the floor, for each start (the best schedule met on the way is kept)."""
    is_long = [0.0] * len(arrivals)
    for i in longest:
        is_long[i] = 1.0
    best: list[bool] | None = None
    for start in starts:
        def meets(price: float) -> bool:
            nonlocal best
            on_time = witness(arrivals, device, deadline_ms, max_batch, [1.0 + price * x for x in is_long], start, passes)
            if sum(on_time[i] for i in longest) < floor:
                return False
            if best is None or sum(on_time) > sum(best):
                best = on_time
            return True

        if meets(0.0):
            continue
        low, high = 0.0, 1.0
        while not meets(high) and high < 1024:
            low, high = high, 2 * high
        for _ in range(8):
            mid = (low + high) / 2
            low, high = (low, mid) if meets(mid) else (mid, high)
    return best if best is not None else [False] * len(arrivals)


def main(argv: list[str] | None = None) -> int:
    """Per speed-up, requests on time less the planner's: the clairvoyant schedule and the fluid
    bound, with no floor and with the longest tenth at 0.9 of FIFO-drop's share (issue 26)."""
    from benchmarks.bursty import DEADLINE_MS, DEVICE, FAIR_SHARE, longest_tenth   # here: bursty imports bound

    ap = argparse.ArgumentParser(prog="python -m benchmarks.clairvoyant", description=__doc__.split("\n\n")[0])
    add_replay_options(ap)
    args = start_replay(ap, argv)
    if args is None:
        return 2
    print(f"trace {args.trace.name}; SIMULATED device as benchmarks.bursty; deadline {DEADLINE_MS:g} ms; "
          f"requests on time, less the planner's (the longest tenth, of FIFO-drop's share)\n")
    print(f"| speed-up | planner | clairvoyant schedule | upper bound | clairvoyant, tenth >= {FAIR_SHARE:g} | "
          f"upper bound, tenth >= {FAIR_SHARE:g} |")
    print("|---|---|---|---|---|---|")
    rows = read_trace_csv(args.trace)
    for speedup in (float(s) for s in args.speedups.split(",")):
        arrivals = sped_up(rows, speedup)
        longest = longest_tenth(arrivals)
        fifo_long = fifo_drop_hopeless(arrivals, DEVICE, DEADLINE_MS).share(longest)
        floor = FAIR_SHARE * fifo_long * len(longest)
        plan = edf_plan_drop_largest(arrivals, DEVICE, DEADLINE_MS).on_time
        long_set = set(longest)
        free = max((witness(arrivals, DEVICE, DEADLINE_MS, start=start, passes=2) for start in (None, plan)), key=sum)
        fair = witness_with_floor(arrivals, DEVICE, DEADLINE_MS, longest, floor,
                                  starts=(None, [p or i in long_set for i, p in enumerate(plan)]))
        if sum(free[i] for i in longest) >= floor and sum(free) > sum(fair):
            fair = free

        def cell(on_time: list[bool]) -> str:
            tenth = sum(on_time[i] for i in longest) / len(longest) / fifo_long
            return f"{sum(on_time) - sum(plan):+d} ({tenth:.2f})"

        bound = most_on_time(arrivals, DEVICE, DEADLINE_MS) - sum(plan)
        fair_bound = most_on_time(arrivals, DEVICE, DEADLINE_MS, longest=longest, floor=floor) - sum(plan)
        print(f"| x{speedup:g} | {sum(plan)} ({sum(plan[i] for i in longest) / len(longest) / fifo_long:.2f}) | "
              f"{cell(free)} | {bound:+.0f} | {cell(fair)} | {fair_bound:+.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
