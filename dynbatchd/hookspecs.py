"""Every dynbatchd hook, one docstring each.

Hooks see plain data (frozen structs, dataclasses and the frozen config), never sockets or
processes. Built-in plugins (package ``dynbatchd_plugins``) and third-party
ones register through the same entry-point group, ``dynbatchd``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import pluggy

if TYPE_CHECKING:
    from dynbatchd.config import Config

PROJECT = "dynbatchd"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class RequestInfo(msgspec.Struct, frozen=True, gc=False):
    """What routing and admission may know of a request: metadata, never the payload."""
    model: str
    tags: tuple[str, ...] = ()
    request_type: str | None = None
    user_frequency: str | None = None
    tokens: int = 0
    priority: int | None = None
    tenant: str | None = None
    user: str | None = None


@dataclass(frozen=True, slots=True)
class Violation:
    """A broken rule: the config key (or request field) and what is wrong."""
    key: str
    rule: str
    plugin: str = ""


@dataclass(slots=True)
class WarmupJob:
    """Inputs a warmup plugin wants precomputed for `model`, most valuable first."""
    model: str
    inputs: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------

@hookspec(firstresult=True)
def dynbatchd_route(request: RequestInfo, config: Config) -> str | None:
    """Name the channel for `request`.

    Called once per accepted request, before admission checks. Return a
    channel name from ``config.channels``, or None to let the next plugin
    decide. The first non-None answer wins; with no answer the request goes
    to ``config.routing.default``.
    """


# ---------------------------------------------------------------------------
# wait windows and batch size
# ---------------------------------------------------------------------------

@hookspec
def dynbatchd_window_policies() -> dict[str, Any]:
    """Register wait-window policies by name.

    Return ``{name: factory}``; ``factory(channel, settings, options)`` builds
    a `dynbatchd.scheduler.policies.WindowPolicy` for one channel. Channels
    select a policy with ``[channels.NAME.window] policy = "..."``. Called
    once at start and on reload; every plugin's answer is merged, and a name
    registered twice is an error.
    """


@hookspec
def dynbatchd_batch_sizers() -> dict[str, Any]:
    """Register batch-size policies by name.

    Return ``{name: factory}``; ``factory(channel, settings, options)`` builds
    a `dynbatchd.scheduler.policies.BatchSizer`. Channels select one with
    ``[channels.NAME.batch_size] policy = "..."`` (default ``static``: the
    channel's max_batch). Merged like window policies.
    """


# ---------------------------------------------------------------------------
# compliance
# ---------------------------------------------------------------------------

@hookspec
def dynbatchd_check_config(config: Config) -> list[Violation] | None:
    """Check a whole configuration, at load and at every reload.

    Return the rules it breaks (or None / []). Every plugin votes and any
    violation refuses the configuration; the daemon keeps its old config on
    a refused reload.
    """


@hookspec
def dynbatchd_admit(request: RequestInfo, channel: str, config: Config) -> str | None:
    """Check one request at admission, after routing.

    Return a reason to refuse it (the client gets error ``refused`` with this
    text), or None to let it in. Every plugin votes; any refusal wins.
    """


# ---------------------------------------------------------------------------
# cache warmup
# ---------------------------------------------------------------------------

@hookspec
def dynbatchd_warmup(model: str, top_users: int, config: Config) -> WarmupJob | None:
    """Name inputs to precompute into the result cache before traffic needs them.

    Called by ``dynbatchctl warmup`` (typically from cron, off-peak). Return a
    `WarmupJob` or None; the daemon runs every job's inputs through the bulk
    path and keeps the results in its cache.
    """


# ---------------------------------------------------------------------------
# model runners
# ---------------------------------------------------------------------------

@hookspec
def dynbatchd_runners() -> dict[str, Any]:
    """Register model runners by name.

    Return ``{name: runner_class}``; ``[models.NAME] runner = "..."`` selects
    one. Called in the daemon (to check names) and in each worker process (to
    build the runner). A runner class takes ``(device, options)`` and provides
    ``load()``, ``run(items)`` and the attribute ``simulated``.
    """
