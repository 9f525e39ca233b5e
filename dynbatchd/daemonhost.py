"""What the listeners and the front doors need of the daemon, as a typing Protocol.

`dynbatchd.listeners` and `dynbatchd.doors` are used by `dynbatchd.service`; naming the
`Daemon` class in their annotations made an import circle (service -> listeners -> service).
They name this shape instead, which the `Daemon` has, so the imports run one way only.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from dynbatchd import protocol as P


class DaemonHost(Protocol):
    """The daemon as its listeners and front doors see it: its state and config, its plugins and
    quotas, the sockets they bind into it, and the one request entry point."""

    config: Any       # dynbatchd.config.Config
    plugins: Any      # dynbatchd.plugins.Plugins
    quotas: Any       # dynbatchd.quotas.Quotas
    state: str        # "starting", "serving", "unavailable", "draining"...
    curve: Any        # dynbatchd.curve.CurveServer | None
    control: Any      # dynbatchd.control.server.ControlServer | None
    front: Any        # dynbatchd.transport.FrontEnd | None
    doors: list[Any]  # started front-door plugins
    operations: Any   # dynbatchd.operations.Operations: its metrics_page serves /metrics
    clock: Callable[[], int]   # the engine's clock (ns): the front end stamps each drain it reads with it

    def on_request(self, envelope: list[bytes], request: P.Request, frames: list[bytes]) -> None: ...
