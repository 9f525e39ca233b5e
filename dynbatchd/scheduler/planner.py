"""A channel's batch planner: `form` cuts a ready lane's batch, `_planned_first` picks its
requests (the queue in deadline order cut into full batches, or where deadlines need it when the
extra batches pay; sizes planned where tokens outweigh the per-batch cost; long requests kept to
their share). A base of `Channel`.
"""

from __future__ import annotations

import heapq
import math

from dynbatchd.scheduler.lanes import Batch, Item, Lane
from dynbatchd.scheduler.policies import MS


class _CutPlan:
    """A plan being cut (`Planning._cut_plan`): where its last batch ends, and how big its first is.
    It remembers its state after each request placed, so dropping one replans only those after it."""

    def __init__(self, start: int, limit: int, slip: int, coefficients: tuple[float, float, float]):
        self.limit, self.slip, self.coefficients = limit, slip, coefficients
        self.end = start
        self.first = 0       # the first batch's size, once a second opens (0: one batch so far)
        self.size = 0        # the last batch's
        self.due = 0         # the last batch's first deadline, less the slip
        self.batches = 0     # how many it cuts
        self._states = [(start, 0, 0, 0, 0)]   # (end, first, size, due, batches) after each placed

    def place(self, item: Item) -> bool:
        """Put `item` in the last batch, or in a new one; False (the plan unchanged) if either ends late."""
        return bool(self.place_all([item], [0.0])[0])

    def place_all(self, items: list[Item], weights: list[float]) -> tuple[list[Item], list[float]]:
        """`place` each of `items` in turn; (those placed, their `weights`). One call for a run
        of requests: a plan of hundreds replans the requests after each one it drops."""
        base, per_item, per_token = self.coefficients
        limit, slip, states = self.limit, self.slip, self._states
        end, first, size, due, batches = self.end, self.first, self.size, self.due, self.batches
        placed: list[Item] = []
        placed_weights: list[float] = []
        for item, weight in zip(items, weights):
            own = per_item + per_token * item.tokens
            if size and size < limit and end + own <= due:
                end, size = end + own, size + 1
            elif end + base + own > item.deadline_ns - slip:
                continue
            else:
                first = first or size
                batches += 1
                end, size, due = end + base + own, 1, item.deadline_ns - slip
            states.append((end, first, size, due, batches))
            placed.append(item)
            placed_weights.append(weight)
        self.end, self.first, self.size, self.due, self.batches = end, first, size, due, batches
        return placed, placed_weights

    def rewind(self, placed: int) -> None:
        """Back to the plan of its first `placed` requests."""
        del self._states[placed + 1:]
        self.end, self.first, self.size, self.due, self.batches = self._states[placed]


def _drop_costliest(kept: list[Item], weights: list[float]) -> tuple[int, Item]:
    """Take the request of the most weight (the first of them, in deadline order) out of `kept`
    and its weight out of `weights`, the list beside it; (where it was, it). Over plain floats,
    so a plan of hundreds of requests costs no Python call per request it weighs."""
    gone = weights.index(max(weights))
    del weights[gone]
    return gone, kept.pop(gone)


class Planning:
    """`Channel`'s batch forming and planning; the state it reads is set in `Channel.__init__`."""

    def _over_budget(self, size: int, tokens: int, budget_ns: int | None) -> bool:
        """Whether a batch of `size` (`tokens`) may run longer than `budget_ns` (None: no budget).
        Before this channel has timed a batch its cost is unknown (the fit says 0, every batch
        free): under a budget it then runs one request at a time. Else the first batch after a
        start, 8 bulk requests of 125k tokens (262 ms), held the device past a realtime deadline."""
        return budget_ns is not None and (not self.cost.samples or self.cost.estimate_ns(size, tokens) > budget_ns)

    def form(self, lane: Lane, batch_id: int, now_ns: int, start_ns: int | None = None,
             budget_ns: int | None = None) -> Batch:
        """Cut a batch from `lane` that will start at `start_ns` (default now).

        Where request sizes matter (`_sizes_matter`), the first batch of a plan
        of the queue that gets the most requests done in time (`_planned_first`:
        deadline order, full batches, the largest request dropped from the plan
        while its last batch would be late; batches cut where deadlines need them if
        that keeps more than the extra batches cost). Otherwise earliest deadline first,
        up to the size and token caps. A batch never runs longer than `budget_ns`
        (by the learned cost; `_over_budget`) but for its first request: what a channel of higher
        priority can wait for.
        """
        limit = self.sizer.max_batch()
        cap = self.settings.max_tokens
        start = now_ns if start_ns is None else start_ns
        picked = None
        if len(lane) > 1 and not self.settings.run_late and not lane.heap[0][2].retries and self._sizes_matter(lane):
            price = self.long_ledger.price if self.settings.long_share > 0 else 0.0
            picked = self._planned_first(lane, start, limit, cap, price, budget_ns)
        if picked:
            items = lane.take(picked)
            tokens = sum(item.tokens for item in items)
            self.long_ledger.served([i.tokens for i in items])
        else:
            items, tokens = [], 0
            while lane.heap and len(items) < limit:
                nxt = lane.heap[0][2]
                if items and ((cap and tokens + nxt.tokens > cap) or nxt.retries or items[0].retries):
                    break   # a request whose worker died under it runs alone: one poison input kills only itself
                if items and self._over_budget(len(items) + 1, tokens + nxt.tokens, budget_ns):
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
        planned_end = start + self.cost.estimate_ns(len(items), tokens) if self.cost.settled else 0
        return Batch(batch_id, self.name, lane.model, items, now_ns, limit, tokens, planned_end)

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

    def latency_bound(self, limit: int) -> bool:
        """Whether the channel's deadline is shorter than one full batch of its usual requests
        takes (the learned cost): every plan is then a single batch, and a request dropped from
        it waits out that whole batch, which its deadline cannot afford, so the drop refuses it
        for certain to save the earliest request a lateness that is only predicted (issue 30:
        MiniLM at p99 <= 50 ms, 7.7 ms + 0.25 ms a token, every plan one batch). The usual request
        is the median one: a mean that a few huge requests pull up read a 1 s channel of 7k-token
        requests as latency-bound in its bursts (the Mooncake trace, 191 requests late at x12)."""
        full = self.cost.estimate_ns(limit, int(limit * self.median_tokens.value))
        return full > self.settings.deadline_ms * 1_000_000

    FAILING_AT_MOST = 0.02    # a share of recent requests late or failed above which no late head is kept
    FAILING_MEMORY = 1000     # requests the share follows (each weighs 1/1000 less per request after it)
    FAILING_FADE = 20         # deadlines: the share's time constant, so an overload is forgotten once over

    def counted_outcomes(self, count: int, failed: int, now_ns: int) -> None:
        """`count` requests' outcomes for `failing_share`, `failed` of them refused (overloaded),
        expired or answered late, the rest answered in time (counted first: a batch is one event)."""
        if not failed and not self.failing:   # (the common case: nothing missed, lately or now)
            self._failing_at = now_ns
            return
        keep = 1.0 - 1.0 / self.FAILING_MEMORY
        share = self.failing_share(now_ns) * keep ** (count - failed)
        for _ in range(failed):
            share = share * keep + (1.0 - keep)
        self.failing, self._failing_at = share, now_ns

    def failing_share(self, now_ns: int) -> float:
        """The share of recent requests late or failed: over about the last FAILING_MEMORY, fading
        with a time constant of FAILING_FADE deadlines (a lull after an overload clears it)."""
        idle = now_ns - self._failing_at
        if idle <= 0 or not self.failing:
            return self.failing
        return self.failing * math.exp(-idle / (self.FAILING_FADE * self.settings.deadline_ms * MS))

    def keeps_late_heads(self, limit: int, now_ns: int) -> bool:
        """Whether a single-batch plan that is mostly on time runs as it is (`_mostly_on_time`): in
        a `latency_bound` channel, while at most FAILING_AT_MOST of its recent requests were late
        or failed. A late head trades a certain refusal for a lateness only predicted, which serves
        a p99 target while misses are rare (issue 30: MiniLM at p99 <= 50 ms, under 0.1% errors).
        Once more than 2 in 100 miss, a p99 target is lost anyway, and a head answered late only
        takes device time from the requests behind it. A late head counts either way (late, or
        expired once dropped), so the share does not feed itself; it fades in a lull, so an
        overload is not carried into the traffic after it. Measured (docs/benchmarks.md, "Late
        heads by the regime"): `benchmarks.spread_bursts` 5,892 -> 7,356 on time of 16,080
        (FIFO-drop 6,508); issue 30's knee passes unchanged; after an overload, no more seeds
        over the 0.1% error bar than without the rule."""
        return self.latency_bound(limit) and self.failing_share(now_ns) <= self.FAILING_AT_MOST

    @staticmethod
    def _mostly_on_time(kept: list[Item], end: int, slip: int) -> bool:
        """Whether most of a single batch ending at `end` is on time: its lateness then falls on
        the few at its head, a prediction that may not come true, and a channel that
        `keeps_late_heads` runs it rather than refuse one. Where most of it would be late (a burst that arrived at
        once: all its deadlines alike), keeping it would answer the whole burst late, so the plan
        drops as it does anywhere else."""
        late = sum(1 for item in kept if item.deadline_ns - slip < end)
        return 2 * late <= len(kept)

    def _cut_plan(self, candidates: list[Item], weights: list[float], start: int, limit: int,
                  slip: int) -> tuple[list[Item], list[Item], int]:
        """The plan of `candidates` (deadline order) with batches cut where they must be, not only
        when full: a request joins the last batch while that batch's first still ends in time,
        else opens a batch of its own; when even that would end late, the request of the most
        `weights` (device time per request it counts) leaves the plan. Returns (what it keeps,
        its first batch, how many batches it cuts)."""
        coefficients = self.cost.coefficients()
        kept: list[Item] = []
        kept_weights: list[float] = []
        plan = _CutPlan(start, limit, slip, coefficients)
        for item, weight in zip(candidates, weights):
            kept.append(item)
            kept_weights.append(weight)
            while not plan.place(item):
                gone, _ = _drop_costliest(kept, kept_weights)
                if gone == len(kept):
                    break   # (it was this request)
                plan.rewind(gone)   # (those before it are placed as they were)
                kept[gone:-1], kept_weights[gone:-1] = plan.place_all(kept[gone:-1], kept_weights[gone:-1])
        return kept, kept[:plan.first or len(kept)], plan.batches

    SUSTAINED_DEADLINES = 4   # a backlog older than this many deadlines is an overload, not a burst
    # (fitted: 3 to 5 move neither the code trace, whose bursts end within 3, nor the conversation
    # trace, overloaded throughout at x80; 2 costs the code trace 16 requests, 10 the other 1)

    def _extra_batch_worth(self, start: int, limit: int) -> float | None:
        """What each batch a plan cut at deadlines adds is worth, in requests (`_cut_plan` runs
        where it keeps more than its extra batches are worth); None: keep to full batches.
        - Light (`arrival_load` under one device, counting the share channels above take): 0,
          the lull after a burst pays the extra batches' fixed cost.
        - Loaded: the requests the device could serve in that fixed cost, a batch's fixed cost
          over the usual (median) request's device time. Where requests are big (the Mooncake
          trace's of 7k tokens, about half a request) FIFO-drop beat the full-batch plan at
          x12; in the code trace's bursts (1.5k tokens, two requests) cutting keeps 16-31 more
          at x40-x80.
        - Loaded in a backlog older than `SUSTAINED_DEADLINES` deadlines, where a batch costs a
          request or more: None. The plan counts only what is queued, and under a sustained
          overload the extra batches fall on the arrivals it cannot see (the conversation
          trace's requests of 1k at x80: 3 fewer on time).
        - Loaded while channels above take a share: None. Their batches come between this
          plan's, which a plan cut to the edge of its deadlines cannot absorb (the conversation
          trace with 10% urgent traffic: 3 points fewer at x80)."""
        stretch = self.device_stretch
        if self.arrival_load(start) * stretch <= 1.0:
            return 0.0
        if stretch > 1.0:
            return None
        base, per_item, per_token = self.cost.coefficients()
        worth = base / (per_item + per_token * self.median_tokens.value + base / limit)
        since = self._backlogged_since
        sustained = since is not None and start - since >= self.SUSTAINED_DEADLINES * self.settings.deadline_ms * 1_000_000
        return None if sustained and worth >= 1.0 else worth

    PLAN_BATCHES = 16   # how many batches ahead `_planned_first` plans (the rest of a long queue waits its turn;
    # 16 batches of 32 cover the 1 s deadline of the Azure replay at x80, 8 did not: 90.20% -> 90.25%)

    def _planned_first(self, lane: Lane, start: int, limit: int, cap: int, long_price: float = 0.0,
                       budget_ns: int | None = None) -> list[Item]:
        """The first batch of a plan that gets the most requests done in time (Moore and Hodgson's
        rule, for batches): take the queue in deadline order, cut it into full batches run one
        after another from `start` (by the learned cost); whenever the last planned batch would
        end past the earliest deadline in it, drop the largest request planned so far (it costs
        the most device time, so dropping it saves the most for the others) and plan on. The
        batch to run now is the plan's first. A dropped request is not refused: it waits, and a
        later plan may still fit it, or `expire` answers it. While long requests have a price
        (fewer served lately than the channel's share of what FIFO would have, `LongShare`), a long
        request counts 1 + `long_price` requests: the plan drops the request of the most device
        time per request it counts, so the requests just under the long cut go before long ones.
        Every deadline is planned against less `end_slip_ns`, how late batches have ended lately
        past their plan. Requests that cannot make it even alone are left for `expire`; a retried
        request is never planned (it runs alone). In a `latency_bound` channel a single-batch plan
        that is mostly on time drops nothing: it runs late at its head rather than refuse one.
        Where the plan dropped some, in a latency-bound channel too, the batches may be cut short
        of full where a deadline needs it (`_cut_plan`): if that keeps more than its extra batches
        cost (`_extra_batch_worth`: nothing on a light channel, where the lull after the burst
        pays; under load, the requests its fixed cost could serve), its first batch runs. A big
        request then waits for the next batch instead of leaving the plan, and the requests due
        first in a latency-bound channel run on their own instead of late at the head of one."""
        base, per_item, per_token = self.cost.coefficients()
        slip = self.end_slip_ns
        keep_single = self.keeps_late_heads(limit, start)
        if long_price:   # what the plan drops first: the most device time per request it counts
            long_cut = self.long_ledger.long_above()
            def weight(tokens: int) -> float:
                return (per_item + per_token * tokens) / (1.0 + long_price * (tokens > long_cut))
        else:
            def weight(tokens: int) -> float:
                return tokens
        candidates: list[Item] = []
        weights: list[float] = []
        kept: list[Item] = []
        kept_weights: list[float] = []
        tokens = 0
        for deadline, _, item in heapq.nsmallest(self.PLAN_BATCHES * limit, lane.heap):
            if item.retries or start + base + per_item + per_token * item.tokens > deadline - slip:
                continue
            candidates.append(item)
            weights.append(weight(item.tokens))
            kept.append(item)
            kept_weights.append(weights[-1])
            tokens += item.tokens
            while kept:   # (never emptied: a request feasible alone, or the plan before it, fits)
                count = len(kept)
                batches = -(-count // limit)
                end = start + base * batches + per_item * count + per_token * tokens
                if end <= kept[(batches - 1) * limit].deadline_ns - slip:
                    break
                if keep_single and batches == 1 and self._mostly_on_time(kept, end, slip):
                    break
                tokens -= _drop_costliest(kept, kept_weights)[1].tokens
        worth = self._extra_batch_worth(start, limit) if len(kept) < len(candidates) else None
        if worth is not None:
            cut_kept, cut_first, cut_batches = self._cut_plan(candidates, weights, start, limit, slip)
            if len(cut_kept) - len(kept) > worth * (cut_batches - -(-len(cut_kept) // limit)):
                kept = cut_first
        chosen: list[Item] = []
        tokens = 0
        for item in kept:   # the first batch, within the token cap and the time budget
            if len(chosen) == limit or (cap and tokens + item.tokens > cap):
                break
            if chosen and self._over_budget(len(chosen) + 1, tokens + item.tokens, budget_ns):
                break
            chosen.append(item)
            tokens += item.tokens
        return chosen
