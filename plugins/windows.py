"""Wait-window policies shipped with dynbatchd.

``fixed``: the channel's window_ms; ``ewma``: the smoothed inter-arrival gap;
``pattern``: burst / steady / mixed traffic classes; ``tiered``: a window per
request-size (or queue-depth) tier; ``slo``: waits only while a fuller batch
lowers expected latency and the earliest deadline holds; ``bandit``: learns the window online.
Options and rules: `dynbatchd.scheduler.windows`, the policies' one home (this plugin only
registers its table).
"""

from __future__ import annotations

from dynbatchd.hookspecs import hookimpl
from dynbatchd.scheduler import windows


@hookimpl
def dynbatchd_window_policies():
    return windows.factories()   # the scheduler's one table, fixed included
