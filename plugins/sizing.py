"""Batch-size policies shipped with dynbatchd."""

from __future__ import annotations

from dynbatchd.hookspecs import hookimpl
from dynbatchd.scheduler.policies import StaticSizer


@hookimpl
def dynbatchd_batch_sizers():
    return {"static": StaticSizer.factory}
