"""The daemon's addresses, bound before any model loads: a clash fails in a second, named."""

from __future__ import annotations

import logging
import os
import resource
from typing import Any

import zmq

from dynbatchd.config import KeyFileError, UnsafeDirectory
from dynbatchd.control.server import ControlServer
from dynbatchd.daemonhost import DaemonHost
from dynbatchd.doors import LocalDoor
from dynbatchd.metrics import serve as serve_metrics
from dynbatchd.transport import CurveServer, FrontEnd
from dynbatchd.errors import DynbatchdError


log = logging.getLogger("dynbatchd")


class StartupError(DynbatchdError):
    """The daemon cannot start (an address in use...): one line for the operator, exit status 1."""


def raise_open_files_limit() -> None:
    """Take every descriptor the hard limit allows. Each connection takes one, also before its
    handshake: at the usual soft limit (1,024) that many idle TCP connections left no descriptor to
    accept anyone (nor for the daemon's files and workers), and libzmq's accept spun a core."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = hard if hard != resource.RLIM_INFINITY else 1 << 20
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.info("open files limit raised from %d to %d (its hard limit)", soft, target)
    except (ValueError, OSError) as exc:   # not allowed here: the limit stays as it was
        log.info("open files limit left as it is: %s", exc)


async def bind(daemon: DaemonHost, ctx: zmq.Context) -> Any:
    """Bind the control, request and metrics addresses and start the front-door plugins (so their
    probes answer while the models load); StartupError names the one that failed.

    With ``[daemon] curve`` on, the ZAP handler (`CurveServer`) starts first, so no tcp://
    socket ever takes a handshake unchecked; the control socket's ipc:// file is mode 0660.
    """
    settings = daemon.config.daemon
    raise_open_files_limit()
    where, curve, metrics = "daemon.keys_dir", None, None
    try:
        daemon.curve = curve = CurveServer.for_settings(ctx, settings)
        where = settings.control
        daemon.control = ControlServer(ctx, settings.control, daemon, curve=curve)
        where = settings.listen
        daemon.front = FrontEnd(ctx, settings.listen, settings.max_request_bytes, daemon.on_request, curve=curve,
                                clock=daemon.clock)
        where = f"metrics {settings.metrics_listen}"
        metrics = (await serve_metrics(settings.metrics_listen, daemon.operations.metrics_page)
                   if settings.metrics_listen else None)
        api = LocalDoor(daemon)
        for name, factory in daemon.plugins.front_doors().items():
            door = factory(daemon.config, api)
            if door is not None:
                where = f"{name} {getattr(door, 'listen', '')}".strip()
                await door.start()
                daemon.doors.append(door)
        return metrics
    except (zmq.ZMQError, OSError, KeyFileError) as exc:
        if metrics is not None:
            metrics.close()
        for part in (daemon.front, daemon.control):
            if part is not None:
                part.close(linger=0)
        if curve is not None:
            curve.close()
        if isinstance(exc, KeyFileError):
            reason = str(exc)
        elif isinstance(exc, UnsafeDirectory):
            reason = exc.strerror
        else:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise StartupError(f"{where}: {reason[:1].lower() + reason[1:]}") from None
