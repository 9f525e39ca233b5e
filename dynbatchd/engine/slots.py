"""Device slots: when a new batch may be cut, and which device should take it.

Pure logic of the engine's placement, which the live daemon and the simulator
both drive, so both make the same choice. A device runs the batches it holds one after
another: that stays true with several feeders (worker processes) on one GPU,
whose kernels share the device, so the model keeps one queue per device and
sums its batches' device times. What several feeders overlap is the CPU work
around each batch (decode, tokenise, copy back), which the device time does
not count. So a device fed by `feeders` processes holds up to
`feeders + inflight - 1` batches (one per feeder, and `inflight - 1` queued
behind them), and a slot opens at once while a feeder has nothing, so that
feeder prepares its batch while the device runs another's. A further (queued)
slot opens only when the work it holds is due to end within `lead_ns`, or
within the device's own `lead_ns` where its feeders report a CPU stage before
the device (a pipelined worker tokenises the next batch while one runs: it
must have it that early, or the device waits for Python).
Cutting a batch earlier would only make it smaller and then wait behind the
running one anyway; cutting it `lead_ns` early still hides the time to
assemble and send it (`[devices] queue_lead_ms`, or as long as the daemon's
recent passes took where longer: `Engine.step`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class DeviceView:
    """One device as the dispatcher sees it."""
    held: int          # batches sent and not yet answered
    free_at_ns: int    # estimated end of everything it holds (<= now when idle)
    usable: bool = True
    feeders: int = 1   # its worker processes that are up: each takes a batch at once
    lead_ns: int = 0   # its feeders' CPU stage before the device (a queued slot opens at least that early)

    def full(self, inflight: int) -> bool:
        """No slot at all: a batch for each feeder, and `inflight - 1` queued behind them."""
        return self.held >= self.feeders + inflight - 1


def estimated_free_at(held: Iterable[tuple[T, int]], estimate: Callable[[T], int]) -> int:
    """End of the work a device holds: its batches run in the order sent, each from
    max(its send time, the previous one's end), taking `estimate(batch)`."""
    end = 0
    for batch, sent_ns in held:
        end = max(end, sent_ns) + estimate(batch)
    return end


def _opens_at(d: DeviceView, now_ns: int, lead_ns: int) -> int:
    return now_ns if d.held < d.feeders else max(now_ns, d.free_at_ns - max(lead_ns, d.lead_ns))


def open_slots(devices: Sequence[DeviceView], now_ns: int, inflight: int, lead_ns: int) -> tuple[int, int]:
    """(devices that may take a new batch now, ns until the soonest of them could start it).

    One slot per device at a time: once a batch is sent, the device's next slot
    opens by the same rule, so callers dispatch, then ask again.
    """
    free, soonest = 0, None
    for d in devices:
        if not d.usable or d.full(inflight) or _opens_at(d, now_ns, lead_ns) > now_ns:
            continue
        free += 1
        wait = max(1, d.free_at_ns - now_ns) if d.held else 0   # (holding work, however overdue: not idle)
        soonest = wait if soonest is None else min(soonest, wait)
    return free, soonest or 0


def next_opening_ns(devices: Sequence[DeviceView], now_ns: int, inflight: int, lead_ns: int) -> int | None:
    """When the next queued slot opens (None: none will open without a batch finishing)."""
    times = [_opens_at(d, now_ns, lead_ns) for d in devices
             if d.usable and not d.full(inflight) and _opens_at(d, now_ns, lead_ns) > now_ns]
    return min(times) if times else None


def pick_device(devices: Sequence[DeviceView], now_ns: int, inflight: int, lead_ns: int,
                run_ns: Callable[[int], int] | None = None) -> int | None:
    """Index of the open device on which a new batch would finish soonest (fewest held on a tie):
    it starts when the device's work ends, then runs `run_ns(index)` there (default 0: the
    device that can start it soonest)."""
    best, best_key = None, None
    for i, d in enumerate(devices):
        if not d.usable or d.full(inflight) or _opens_at(d, now_ns, lead_ns) > now_ns:
            continue
        start = max(d.free_at_ns, now_ns) if d.held else now_ns
        key = (start + (run_ns(i) if run_ns else 0), d.held)
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best
