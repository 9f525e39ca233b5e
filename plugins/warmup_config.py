"""The ``[plugins.warmup]`` table, owned by the built-in warmup plugin (`dynbatchd_config_tables`).

Its own module so that the table's shape is read without the plugin's I/O, and so that a
misspelt key (``sourse``) is refused at load like a core table's, naming ``plugins.warmup.sourse``.
"""

from __future__ import annotations

from dynbatchd.config import Frozen
from dynbatchd.hookspecs import hookimpl


class WarmupSettings(Frozen, kw_only=True):
    """``source``: a JSON-lines file of users' inputs to warm with; empty: what the daemon observed."""
    source: str = ""


@hookimpl
def dynbatchd_config_tables() -> dict[str, type]:
    return {"warmup": WarmupSettings}
