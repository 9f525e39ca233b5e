"""`dynbatchctl warmup`: ask the daemon to precompute its top users' inputs, and follow it.

The daemon only queues the inputs and answers at once; they run through its
warmup channel a little at a time. With ``--wait`` this shows how many have
run (a rich progress bar, or one line per second when the output is not a
terminal) until the backlog is empty; without it, it returns at once, as the
nightly timer wants.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

Call = Callable[..., Any]


def warmed(status: dict[str, Any], channel: str) -> int:
    """Warmup inputs the channel has run so far (its counter since the daemon started)."""
    return status["channels"].get(channel, {}).get("warmup", {}).get("items", 0)


def nothing_left_to_warm(status: dict[str, Any], channel: str) -> bool:
    """Whether no warmup input can still run: none in the backlog and none queued in `channel` (an
    input counts as warmed once it leaves the queue for a device), or the daemon is stopping."""
    if (status.get("cache") or {}).get("warmup_backlog"):
        return False
    return status["daemon"]["state"] != "serving" or not status["channels"].get(channel, {}).get("queue_depth")


def follow(call: Call, channel: str, queued: int, before: int, out: Console, *, poll_s: float = 0.5,
           timeout_s: float = 3600.0) -> int:
    """Poll the daemon until `queued` warmup inputs have run in `channel` (or the backlog is gone
    and nothing moves any more); the number that ran."""
    done, deadline, printed = 0, time.monotonic() + timeout_s, -1.0
    columns = (TextColumn("warming"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=out, transient=False, disable=not out.is_terminal) as bar:
        task = bar.add_task("warmup", total=queued)
        while done < queued and time.monotonic() < deadline:
            status = call("status")
            done = min(queued, warmed(status, channel) - before)
            bar.update(task, completed=done)
            if not out.is_terminal and (done == queued or time.monotonic() - printed >= 1.0):
                out.print(f"warmed {done}/{queued}", highlight=False)   # a log line a second, not a frame
                printed = time.monotonic()
            if done < queued and nothing_left_to_warm(status, channel):
                break   # dropped (the daemon stops, `forget` erased them): waiting would last until timeout_s
            if done < queued:
                time.sleep(poll_s)
    return done
