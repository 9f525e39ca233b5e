"""Batch-size policies shipped with dynbatchd.

``static``: the channel's max_batch, lowered after an out-of-memory;
``adaptive``: the guide's utilisation / memory / queue rule with hysteresis
(`dynbatchd.scheduler.sizing.AdaptiveSizer`).
"""

from __future__ import annotations

from dynbatchd.hookspecs import hookimpl
from dynbatchd.scheduler import sizing


@hookimpl
def dynbatchd_batch_sizers():
    return sizing.factories()   # the scheduler's one table, static included
