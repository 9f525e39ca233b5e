"""Device slots: when a new batch may be cut, and which device should take it.

Pure logic shared by the live daemon (`devices.pool`) and the simulator, so
both make the same choice. A device holds up to `inflight` batches and runs
them one after another. Its first slot opens when it is idle; a further
(queued) slot opens only when the work it holds is due to end within
`lead_ns`. Cutting a batch earlier would only make it smaller and then wait
behind the running one anyway; cutting it `lead_ns` early still hides the
time to assemble and send it.
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


def estimated_free_at(held: Iterable[tuple[T, int]], estimate: Callable[[T], int]) -> int:
    """End of the work a device holds: its batches run in the order sent, each from
    max(its send time, the previous one's end), taking `estimate(batch)`."""
    end = 0
    for batch, sent_ns in held:
        end = max(end, sent_ns) + estimate(batch)
    return end


def _opens_at(d: DeviceView, now_ns: int, lead_ns: int) -> int:
    return now_ns if d.held == 0 else max(now_ns, d.free_at_ns - lead_ns)


def open_slots(devices: Sequence[DeviceView], now_ns: int, inflight: int, lead_ns: int) -> tuple[int, int]:
    """(devices that may take a new batch now, ns until the soonest of them could start it).

    One slot per device at a time: once a batch is sent, the device's next slot
    opens by the same rule, so callers dispatch, then ask again.
    """
    free, soonest = 0, None
    for d in devices:
        if not d.usable or d.held >= inflight or _opens_at(d, now_ns, lead_ns) > now_ns:
            continue
        free += 1
        wait = max(0, d.free_at_ns - now_ns) if d.held else 0
        soonest = wait if soonest is None else min(soonest, wait)
    return free, soonest or 0


def next_opening_ns(devices: Sequence[DeviceView], now_ns: int, inflight: int, lead_ns: int) -> int | None:
    """When the next queued slot opens (None: none will open without a batch finishing)."""
    times = [_opens_at(d, now_ns, lead_ns) for d in devices
             if d.usable and d.held < inflight and _opens_at(d, now_ns, lead_ns) > now_ns]
    return min(times) if times else None


def pick_device(devices: Sequence[DeviceView], now_ns: int, inflight: int, lead_ns: int,
                run_ns: Callable[[int], int] | None = None) -> int | None:
    """Index of the open device on which a new batch would finish soonest (fewest held on a tie):
    it starts when the device's work ends, then runs `run_ns(index)` there (default 0: the
    device that can start it soonest)."""
    best, best_key = None, None
    for i, d in enumerate(devices):
        if not d.usable or d.held >= inflight or _opens_at(d, now_ns, lead_ns) > now_ns:
            continue
        start = max(d.free_at_ns, now_ns) if d.held else now_ns
        key = (start + (run_ns(i) if run_ns else 0), d.held)
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best
