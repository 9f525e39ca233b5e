"""A channel: bounded queues in deadline order, and the rule for when a batch is ready.

A channel holds one *lane* per model (and, for isolated channels, per tenant;
with ``token_buckets``, per length bucket): a batch is always cut from one
lane, so requests of different models, or of different tenants of a regulated
channel, never share a batch, and short requests never pad up to long ones.

The queue's bookkeeping is here; admission and expiry are in `dynbatchd.scheduler.admission`, the
batch planner in `dynbatchd.scheduler.planner`, the queued things in `dynbatchd.scheduler.lanes`
(re-exported here).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Any, Hashable

from dynbatchd.scheduler.arrivalgaps import ArrivalGaps
from dynbatchd.scheduler.longshare import LongShare
from dynbatchd.scheduler.cost import CostModel
from dynbatchd.scheduler.policies import MS, BatchSizer, LaneState, WindowPolicy
from dynbatchd.scheduler.quantile import RunningQuantile
from dynbatchd.telemetry import ChannelStats
from dynbatchd.scheduler.admission import Admission
from dynbatchd.scheduler.lanes import NEVER, Batch, Item, Lane  # noqa: F401  (re-exported)
from dynbatchd.scheduler.planner import Planning



class Channel(Admission, Planning):
    """A channel's lanes, rates and readiness; admission and planning come from its bases."""

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
        self.arrival_gaps = ArrivalGaps()   # when its next request is likely (`Scheduler._held_until`)
        self.mean_tokens = 0.0          # of accepted requests, exponentially weighted
        self._load = 0.0                # `arrival_load`, as of _load_at
        self._load_at = 0
        self.median_tokens = RunningQuantile(0.5)   # of accepted requests: the usual one (`latency_bound`)
        self.last_window_ns: int | None = None
        self.long_ledger = LongShare()
        self.device_stretch = 1.0   # wall time per unit of its device time (`Scheduler._stretch`)
        self._slips: deque[int] = deque(maxlen=self.SLIP_BATCHES)   # recent batches' ends past their plan
        self.end_slip_ns = 0            # aimed before each deadline (`batch_ended`)
        self.failing = 0.0              # recent requests late or failed, as of _failing_at (`failing_share`)
        self._failing_at = 0
        self._slips_new = 0             # batches since it was last read
        self._probed_ns = -self.PROBE_EVERY_NS   # when `expire` last let a hopeless request try
        self._spared: tuple[int, set[int]] = (0, set())   # (CostModel.disputes episode logged, keys it spared)

    ARRIVAL_TAU_NS = 10_000_000_000   # the offered rate `status` shows follows the last ~10 s

    RATE_TAU_NS = 500_000_000   # the drain rate follows the last ~half second
    LAG_REFRESH_NS = 1_000_000  # how often a backlogged channel re-reads its rates (admission asks per request)

    def arrival_rate(self, now_ns: int) -> float:
        """Accepted requests per ns, recently."""
        return self._arrivals * math.exp(-(now_ns - self._arrivals_at) / self.ARRIVAL_TAU_NS)

    def arrival_load(self, now_ns: int) -> float:
        """Device time per unit of time that the requests accepted over about the last deadline
        ask for (by the learned cost; 1: one device's worth). Under 1, a plan may spend a batch's
        fixed cost to keep a request (`_cut_plan`): the lull after the burst pays for it; over 1,
        only where that keeps more than the fixed cost could serve (`_extra_batch_worth`)."""
        return self._load * math.exp(-(now_ns - self._load_at) / (self.settings.deadline_ms * MS))

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
        if free_slots > 0 and busy_ns <= 0 and self.plans_by_size():
            window_end = min(window_end, lane.opened_ns + self.idle_hold_ns())
        # Close early when waiting longer would make the most urgent request miss (1 ns sooner than
        # the truncated estimate says: the plan cut then checks the same batch without truncating).
        # Aim `end_slip_ns` sooner still: batches have lately ended that much past their plan.
        urgent = lane.head_deadline() - self.cost.estimate_ns(min(len(lane), limit), lane.tokens) - self.end_slip_ns - 1
        return min(window_end, urgent)

    SLIP_BATCHES = 64     # how many recent batches `end_slip_ns` reads
    SLIP_QUANTILE = 0.9
    SLIP_EVERY = 8        # batches between readings, once SLIP_BATCHES are in
    SLIP_MAX_SHARE = 0.05   # of the channel's deadline: a stall (a pause, a slow device) does not empty every plan

    def batch_ended(self, batch: Batch, now_ns: int) -> None:
        """Learn how late batches end past their plan (`Batch.planned_end_ns`): the learned cost's
        error, the hand-over to the device and back, a batch queued behind one that ran long.
        Plans and windows then aim `end_slip_ns` before each deadline: the 90th percentile of
        the last batches' slips, at least 0, at most a twentieth of the deadline. Where the
        cost model is exact (the simulator) it stays 0; on a live daemon, a plan that fills
        batches to the edge of their deadlines (a backlog) otherwise answers some a few ms late."""
        if not batch.planned_end_ns:
            return
        slips = self._slips
        slips.append(now_ns - batch.planned_end_ns)
        self._slips_new += 1
        if self._slips_new < self.SLIP_EVERY and len(slips) == self.SLIP_BATCHES:
            return   # (read again every few batches: at batches of one or two, a sort per batch is a few % of the CPU)
        self._slips_new = 0
        high = sorted(slips)[int(self.SLIP_QUANTILE * (len(slips) - 1))]
        self.end_slip_ns = max(0, min(high, int(self.SLIP_MAX_SHARE * self.settings.deadline_ms * MS)))

    def idle_hold_ns(self) -> int:
        """The longest a planned channel's window holds an idle device: a batch's fixed cost (the
        learned `base`). What arrives during a hold joins the held batch instead of the next one,
        which saves at most that one fixed cost; the device time held beyond it is lost to every
        request behind in the busy period that follows (the plan, not the window, cuts the
        batches of a backlog). Where tokens do not outweigh a request's cost the window stands."""
        return int(self.cost.coefficients()[0])

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
                "arrival_load": round(self.arrival_load(now_ns), 3),
                "mean_tokens": round(self.mean_tokens, 1),
                "cost_ms": {"base": base / 1e6, "per_item": per_item / 1e6, "per_token": per_token / 1e6,
                            "samples": self.cost.samples},
                "end_slip_ms": self.end_slip_ns / 1e6,
                "long_price": round(self.long_ledger.price, 3),
                "failing": round(self.failing_share(now_ns), 4)}
