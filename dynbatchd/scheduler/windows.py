"""Wait-window policies: the one registry of the built-ins, and the rules they all keep.

Each is a plain object with the `WindowPolicy` protocol of
`dynbatchd.scheduler.policies`: ``on_arrival`` per accepted request,
``on_batch_done`` per finished batch, ``window_ns(now, lane)`` whenever the
scheduler asks whether a lane's batch is ready (it is ready once
``lane.opened_ns + window`` has passed), and ``describe()`` for status. Times
are integer nanoseconds from the scheduler's injected clock; nothing here
reads wall time. A policy sees every arrival of its channel (all lanes
together), so rates and spreads are per channel.

Options come from ``[channels.NAME.window] options = {...}``; an unknown or
out-of-range option is a ValueError naming the key, like any config error.
The channel's ``window_ms`` bounds every window (the scheduler enforces it,
since compliance rules and the operator's latency budget rely on it); the
factories apply the same bound, so ``describe()`` shows the window in force: a
configured figure above ``window_ms`` acts as ``window_ms``.

Every built-in policy has one home, in the scheduler (``fixed`` in `dynbatchd.scheduler.policies`,
``ewma`` and ``pattern`` in `arrivalwindows`, ``tiered`` and ``slo`` in `targetwindows`, ``bandit``
in `banditwindow`, no longer in plugins/): the scheduler and the simulator build channels without
plugins, and the scheduler imports nothing above it. `factories` is the table; the built-in ``windows`` plugin registers it, as any plugin
registers its own.
"""

from __future__ import annotations

from typing import Any

from dynbatchd.scheduler.arrivalwindows import EwmaWindow, PatternWindow
from dynbatchd.scheduler.banditwindow import BanditWindow
from dynbatchd.scheduler.policies import FixedWindow
from dynbatchd.scheduler.targetwindows import DEFAULT_TIERS, SloWindow, TieredWindow  # noqa: F401
from dynbatchd.scheduler.windowkit import SECOND, _where  # noqa: F401  (re-exported)


def factories() -> dict[str, Any]:
    """Name → factory of every built-in window policy, for the built-in windows plugin (and for
    `build_channels` when it is given no registry)."""
    return {"fixed": FixedWindow.factory, "ewma": EwmaWindow.factory, "pattern": PatternWindow.factory,
            "tiered": TieredWindow.factory, "slo": SloWindow.factory, "bandit": BanditWindow.factory}
