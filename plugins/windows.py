"""Wait-window policies shipped with dynbatchd."""

from __future__ import annotations

from dynbatchd.hookspecs import hookimpl
from dynbatchd.scheduler.policies import FixedWindow


@hookimpl
def dynbatchd_window_policies():
    return {"fixed": FixedWindow.factory}
