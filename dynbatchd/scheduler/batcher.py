"""The scheduler: when to close a batch, and which ready batch a free device slot takes.

Pure logic. It never reads a clock (every call takes ``now_ns``), never
touches sockets, and never runs a model, so a test can replay thousands of
arrivals against a fake clock in milliseconds, and the same code drives both
the live daemon and the simulated accelerator used for capacity planning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from dynbatchd.scheduler.arrivalgaps import ArrivalGaps
from dynbatchd.scheduler.channel import NEVER, Batch, Channel, Item, Lane
from dynbatchd.errors import OptionError
from dynbatchd.scheduler import sizing, windows

PolicyFactory = Callable[[str, Any, dict[str, Any]], Any]
DEFAULT_WINDOW_POLICY = "fixed"   # a channel without [window]: its window_ms, as configured
DEFAULT_SIZER = "static"          # a channel without [batch_size]: its max_batch, as configured


@dataclass(slots=True)
class Decision:
    batches: list[Batch] = field(default_factory=list)
    expired: list[Item] = field(default_factory=list)


def build_channels(channels: dict[str, Any],
                   window_policies: dict[str, PolicyFactory] | None = None,
                   sizers: dict[str, PolicyFactory] | None = None) -> dict[str, Channel]:
    """Channels from settings, each with the window and batch-size policy it names.

    `window_policies` / `sizers`: name -> factory, the plugins' registries. The built-ins come
    through the same tables (`windows.factories`, `sizing.factories`, which the built-in plugins
    register), laid under the ones given so a scheduler test or a simulation needs no plugin
    manager; a channel that names no policy gets the default by name, like any other.
    """
    window_policies = {**windows.factories(), **(window_policies or {})}
    sizers = {**sizing.factories(), **(sizers or {})}
    built = {}
    for name, settings in channels.items():
        wsel = getattr(settings, "window", None)
        ssel = getattr(settings, "batch_size", None)
        wname, wopts = (wsel.policy, dict(wsel.options)) if wsel else (DEFAULT_WINDOW_POLICY, {})
        sname, sopts = (ssel.policy, dict(ssel.options)) if ssel else (DEFAULT_SIZER, {})
        if wname not in window_policies:
            raise OptionError(f"channels.{name}.window.policy", f"unknown window policy {wname!r}")
        if sname not in sizers:
            raise OptionError(f"channels.{name}.batch_size.policy", f"unknown batch-size policy {sname!r}")
        built[name] = Channel(name, settings, window_policies[wname](name, settings, wopts),
                              sizers[sname](name, settings, sopts))
    return built


class Scheduler:
    def __init__(self, channels: dict[str, Channel]):
        self.channels = channels
        self.draining = False
        self._next_batch_id = 0
        self._recent = {name: 0.0 for name in channels}  # device time dispatched, decayed per batch
        self.intake_steps = ArrivalGaps()   # the instants requests of any channel arrive at (`_held_until`)

    def add_channel(self, channel: Channel) -> None:
        """A channel that joins at run time (a canary's twin)."""
        self.channels[channel.name] = channel
        self._recent[channel.name] = 0.0

    def remove_channel(self, name: str) -> None:
        """Remove an empty channel (the caller knows none of its batches is still running)."""
        if self.channels[name].depth:
            raise ValueError(f"channel {name!r} still holds requests")
        del self.channels[name]
        self._recent.pop(name, None)

    SHARE_MEMORY = 0.99  # each batch, older dispatches count 1% less: shares follow the last ~100 batches

    def _count_share(self, name: str, device_ns: float) -> None:
        """Shares are of device time, not requests: a bulk request of 10k tokens is not one short one."""
        recent = self._recent
        for key in recent:
            recent[key] *= self.SHARE_MEMORY
        recent[name] += device_ns

    # -- inputs -------------------------------------------------------------
    def submit(self, item: Item, now_ns: int, devices: int = 1, idle: bool = True,
               inflight_ns: Callable[[int], int] | None = None) -> bool:
        """Queue a routed request; False means answer `overloaded` (see `Channel.offer`).

        The predicted wait is the device time the work ahead of it needs, spread over the
        `devices` that serve: what they are still to run of the batches they hold
        (`inflight_ns(now_ns)`, asked only when a prediction is made), then its own channel's queue
        and that of every channel of higher priority. No prediction while a device is `idle` or
        while the channel may not refuse on its learned cost (`Channel.refuses_on_cost`: not
        settled, or not confirmed lately).
        """
        channel = self.channels[item.channel]
        if not item.warmup:
            self.intake_steps.arrived(now_ns)
        if idle or channel.depth < channel.sizer.max_batch() or not channel.refuses_on_cost(now_ns) \
                or channel.long_ledger.is_long(item.tokens):   # (less than a batch queued: nothing to predict)
            # (A long request is never judged on the short ones a backlog serves first: its share
            # of what FIFO would have served (`LongShare`, the channel's long_share) or a later plan
            # may serve it; if not in time, it expires. Judged here, with long_share 0, the code
            # trace at x80 loses 19 more requests.)
            return channel.offer(item, now_ns)
        mine = channel.settings.priority
        ahead = inflight_ns(now_ns) if inflight_ns is not None else 0
        for other in self.channels.values():   # (a plain loop: this runs per request under load)
            if other.depth and other.settings.priority > mine:
                ahead += other.backlog_ns()
        wait = (ahead + channel.backlog_ns()) // max(1, devices)
        run = channel.cost.estimate_ns(1, item.tokens)
        if item.deadline_ns < now_ns + wait + run and channel.plans_by_size():
            # Look closer where a backlog's plan serves smaller requests first (it drops the largest).
            # Elsewhere refusing must stay cheap: past the peak most requests are refused.
            wait = (ahead + channel.backlog_ns(up_to_tokens=item.tokens)) // max(1, devices)
        return channel.offer(item, now_ns, wait, run)

    def completed(self, batch: Batch, compute_ns: int, now_ns: int) -> None:
        """A device finished `batch`: teach the cost model and the window policy."""
        channel = self.channels[batch.channel]
        n = len(batch.items)
        channel.cost.observe(n, batch.tokens, compute_ns, now_ns)
        channel.batch_ended(batch, now_ns)
        channel.window.on_batch_done(n, batch.tokens, compute_ns, now_ns)
        if not batch.items[0].warmup:
            channel.stats.compute_ns += compute_ns * n
            late = 0
            for item in batch.items:   # (a plain loop: this runs once a batch)
                if now_ns > item.deadline_ns:
                    late += 1
            channel.counted_outcomes(n, late, now_ns)

    def out_of_memory(self, batch: Batch) -> None:
        """A batch did not fit on the device: that channel's sizer lowers its limit."""
        self.channels[batch.channel].sizer.on_oom(len(batch.items))

    def requeue(self, items: Iterable[Item]) -> None:
        """Put back dispatched requests that did not run; a retried one (`retries` > 0) runs alone."""
        for item in items:
            self.channels[item.channel].requeue(item)

    def take_all(self) -> list[Item]:
        """Remove and return everything queued (stopping: nothing more may start)."""
        out: list[Item] = []
        for channel in self.channels.values():
            channel.take_all(out)
        return out

    def drain(self) -> None:
        """Stop waiting for fuller batches: everything queued is ready now."""
        self.draining = True

    # -- decisions ----------------------------------------------------------
    def poll(self, now_ns: int, free_slots: int, device_busy_ns: int = 0) -> Decision:
        """Answer hopeless requests, then fill up to `free_slots` with the most urgent ready batches.

        `device_busy_ns`: how long until a device with a free slot could start a
        batch (0 when one is idle); window policies may weigh it.
        """
        decision = Decision()
        idle = free_slots > 0 and device_busy_ns == 0
        for channel in self.channels.values():
            channel.expire(now_ns, decision.expired, device_busy_ns, idle)
        while free_slots > 0:
            pick = self._most_urgent_ready(now_ns, free_slots, device_busy_ns)
            if pick is None:
                break
            channel, lane = pick
            self._next_batch_id += 1
            budget = self._budget_ns(channel, now_ns)
            if lane.warmup:
                budget = self._warmup_budget_ns() if budget is None else min(budget, self._warmup_budget_ns())
            channel.device_stretch = self._stretch(channel)
            batch = channel.form(lane, self._next_batch_id, now_ns, now_ns + device_busy_ns, budget)
            decision.batches.append(batch)
            self._count_share(channel.name, channel.cost.estimate_ns(len(batch.items), batch.tokens) or len(batch.items))
            free_slots -= 1
        return decision

    def _stretch(self, channel: Channel) -> float:
        """How much longer than its device time `channel`'s work takes: channels of higher priority
        took that share of recent device time (at most 10)."""
        mine = channel.settings.priority
        total = above = 0.0
        channels = self.channels
        for name, t in self._recent.items():   # (a plain loop: this runs once a batch)
            total += t
            if channels[name].settings.priority > mine:
                above += t
        return 1.0 / max(0.1, 1.0 - above / total) if total > 0 and above > 0 else 1.0

    def _longest_batch_ns(self, channel: Channel, now_ns: int) -> int:
        """How long a batch of `channel` may run: a full one of its usual requests, within its budget."""
        limit = channel.sizer.max_batch()
        full = channel.cost.estimate_ns(limit, int(channel.mean_tokens * limit))
        budget = self._budget_ns(channel, now_ns)
        return full if budget is None else min(full, budget)

    def _budget_ns(self, channel: Channel, now_ns: int) -> int | None:
        """The longest batch `channel` may cut without making a channel of higher priority miss:
        a request arriving there just after this batch starts waits for it, and for one queued
        behind it, then runs its own batch, within its deadline. None: no channel above it, or
        none that is busy (`Channel.quiet`: an idle realtime channel does not shrink every
        standard batch for traffic that does not come)."""
        budgets = []
        for other in self.channels.values():
            s = other.settings
            if s.priority <= channel.settings.priority or other.quiet(now_ns):
                continue
            limit = other.sizer.max_batch()
            own = other.cost.estimate_ns(limit, int(other.mean_tokens * limit))
            budgets.append(int((s.deadline_ms - s.window_ms) * 1_000_000 - own) // 2)
        return max(0, min(budgets)) if budgets else None

    def _warmup_budget_ns(self) -> int:
        """The longest warmup batch: the shortest live window. A live request waits for its
        window anyway, so a warmup batch started just before it arrives ends before that
        request's batch would have closed: warmup fills idle time without delaying anyone."""
        return int(min(c.settings.window_ms for c in self.channels.values()) * 1_000_000)

    def _live_work_queued(self) -> bool:
        return any(lane.heap and not lane.warmup for c in self.channels.values() for lane in c.lanes.values())

    def _most_urgent_ready(self, now_ns: int, free_slots: int, busy_ns: int) -> tuple[Channel, Lane] | None:
        """Which ready lane a free slot serves.

        1. A channel below its configured minimum share of recent device time whose
           most urgent request can wait no longer (so no channel starves under
           overload; work that can still wait does, and a quiet moment may take it:
           a bulk request due in 30 s does not take the device from a standard
           burst due in 1 s);
        2. then lanes whose most urgent request could not wait for the longest
           batch any channel cuts, twice over (the one running and the one
           queued behind it), higher channel priority first (realtime keeps its
           deadlines, lower channels absorb the delay);
        3. then earliest deadline first;
        4. unless a lane of higher priority could not wait for the chosen batch's first request
           (`_waiting_above`): that lane goes first, its window closed (not over a pick by 1).

        Warmup lanes (nobody waits for them) only when a device is idle and no live request
        is queued anywhere, in batches no longer than `_warmup_budget_ns`.
        """
        ready: list[tuple[Channel, Lane, bool]] = []
        total = sum(self._recent.values()) or 1.0
        for channel in self.channels.values():
            if not channel.depth:
                continue
            settings = channel.settings
            starved = settings.min_share > 0 and self._recent[channel.name] / total < settings.min_share
            for lane in channel.lanes.values():
                if lane.warmup and (busy_ns > 0 or self._live_work_queued()):
                    continue   # optional work runs only on an idle device with no live request waiting
                if channel.ready_at(lane, now_ns, free_slots, self.draining, busy_ns) <= now_ns \
                        and self._held_until(channel, lane, now_ns, busy_ns) <= now_ns:
                    ready.append((channel, lane, starved))
        if not ready:
            return None
        if len(ready) == 1 and not ready[0][2]:   # (the only one, picked by no minimum share: no key to weigh)
            best = ready[0][0], ready[0][1]
            return self._waiting_above(best, now_ns, free_slots, busy_ns) or best
        best, best_key = None, None
        batch_time = 2 * max(self._longest_batch_ns(c, now_ns) for c in self.channels.values()) + busy_ns
        for channel, lane, starved in ready:
            deadline = lane.head_deadline()
            urgent = deadline - batch_time - channel.cost.estimate_ns(len(lane), lane.tokens) <= now_ns
            key = (not (starved and urgent), not urgent, -channel.settings.priority if urgent else 0, deadline)
            if best_key is None or key < best_key:
                best, best_key = (channel, lane), key
        if best_key[0]:   # (a pick by its minimum share stands)
            return self._waiting_above(best, now_ns, free_slots, busy_ns) or best
        return best

    def _waiting_above(self, pick: tuple[Channel, Lane], now_ns: int, free_slots: int,
                       busy_ns: int) -> tuple[Channel, Lane] | None:
        """A lane of higher priority than `pick`'s, still in its window, whose requests could not
        wait for `pick`'s batch: its first request alone (the budget caps the rest) would hold the
        device past the moment that lane must start. Its window then closes now: once a bulk
        request of 200 ms takes a device that cannot be preempted, a realtime request waiting out
        its 30 ms window gains nothing and misses its 200 ms deadline."""
        channel, lane = pick
        mine = channel.settings.priority
        above = [other for other in self.channels.values() if other.depth and other.settings.priority > mine]
        if not above or lane.warmup:   # (nothing above holds a request: the common case, and this runs per batch)
            return None
        pick_ends = now_ns + busy_ns + channel.cost.estimate_ns(1, lane.heap[0][2].tokens)   # its first request, at least
        best, best_latest = None, NEVER
        for other in above:
            limit = other.sizer.max_batch()
            for waiting in other.lanes.values():
                if not waiting.heap or waiting.warmup or other.ready_at(waiting, now_ns, free_slots, self.draining, busy_ns) <= now_ns:
                    continue   # (a ready lane was weighed against the pick already)
                latest = waiting.head_deadline() - other.cost.estimate_ns(min(len(waiting), limit), waiting.tokens) \
                    - other.end_slip_ns
                if latest < pick_ends and latest < best_latest:
                    best, best_latest = (other, waiting), latest
        return best

    def _held_until(self, channel: Channel, lane: Lane, now_ns: int, busy_ns: int) -> int:
        """When `lane`'s first request may start, where it runs longer than a busy channel of
        higher priority can wait, alone or after what the device still runs: a request arriving
        there early in its run would miss its deadline behind it, and a device cannot be
        preempted. Now, unless that channel's arrivals come in steps and a later start, within
        the request's slack, is surely less likely to meet one (`ArrivalGaps.safer_start`).
        Where they come at random, no moment is safer. What that channel can wait is read for
        what usually arrives there at once (`ArrivalGaps.usual_instant`: a step brings several
        requests), and the run is exposed from the moment it is handed to a busy device (one
        arriving while it waits there cannot go first). Where that channel has been quiet longer
        than nearly all its gaps, they cannot say, and the steps of all channels' arrivals
        (`intake_steps`) are asked instead: its requests, when they come, come with the
        traffic's. (docs/benchmarks.md: each of these but the device's remaining run cost a
        realtime request in a live Mooncake replay at x12.)"""
        if lane.warmup or not lane.heap or not channel.cost.samples:
            return now_ns
        mine, until, run = channel.settings.priority, now_ns, 0
        for other in self.channels.values():
            if other.settings.priority <= mine or other.quiet(now_ns) or not other.cost.samples:
                continue
            run = run or channel.cost.estimate_ns(1, lane.heap[0][2].tokens)
            count, tokens = other.arrival_gaps.usual_instant()
            if not count:
                count, tokens = 1, int(other.median_tokens.value)
            waits = int(other.settings.deadline_ms * 1_000_000) - other.end_slip_ns \
                - other.cost.estimate_ns(count, tokens)   # what the requests it usually gets at once can wait
            if busy_ns + run > waits:
                latest = lane.head_deadline() - run - channel.end_slip_ns - 2 * self._longest_batch_ns(channel, now_ns)
                # Exposed from now: one that arrives while it waits behind the device's batch cannot go first either.
                exposed = busy_ns + run - waits
                start = other.arrival_gaps.safer_start(now_ns, exposed, latest - busy_ns)
                if start is None:   # its own gaps cannot say (too few, or it has been quiet longer than they go)
                    start = self.intake_steps.safer_start(now_ns, exposed, latest - busy_ns)
                if start is not None:
                    until = max(until, start)
        return until

    def next_wakeup(self, now_ns: int, free_slots: int, device_busy_ns: int = 0) -> int | None:
        """The earliest future time a poll could change something: a window end, an urgency or an expiry.

        Lanes already ready (or any lane, when no slot is free) wait for a device
        slot, not for time, so only their expiry counts; a finished batch is the
        caller's cue to poll again.
        """
        soonest = NEVER
        for channel in self.channels.values():
            if not channel.depth:
                continue
            for lane in channel.lanes.values():
                if not lane.heap:
                    continue
                at = channel.ready_at(lane, now_ns, free_slots, self.draining, device_busy_ns) if free_slots else NEVER
                if at <= now_ns:
                    held = self._held_until(channel, lane, now_ns, device_busy_ns) if free_slots else now_ns
                    at = held if held > now_ns else NEVER
                if not channel.settings.run_late:
                    at = min(at, channel.expires_at(lane, now_ns))
                soonest = min(soonest, at)
        return None if soonest == NEVER else max(soonest, now_ns)

    # -- views --------------------------------------------------------------
    def depth(self) -> int:
        n = 0
        for channel in self.channels.values():   # (a plain loop: asked at least once per scheduling pass)
            n += channel.depth
        return n

    def snapshot(self, now_ns: int = 0) -> dict[str, dict[str, Any]]:
        return {name: c.snapshot(now_ns) for name, c in self.channels.items()}
