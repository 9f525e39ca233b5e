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
    """Text inputs a warmup plugin wants precomputed for `model`, most valuable first (they run in this order).
    `tenant`: whose inputs they are (cached for that tenant's requests only); None for requests without one."""
    model: str
    inputs: list[str] = field(default_factory=list)
    tenant: str | None = None


@dataclass(frozen=True, slots=True)
class CacheRule:
    """What the result cache does with one request: `lookup` (may it be answered from the cache)
    and `store`, how its result is kept: "filter" (only if asked more often than what it would
    replace), "always" (the least recently used goes), "again" (only if asked before), "never"."""
    lookup: bool = True
    store: str = "filter"


# ---------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------

@hookspec(firstresult=True)
def dynbatchd_route(request: RequestInfo, config: Config) -> str | None:
    """Name the channel for `request`.

    Called once per request that decoded and names a known model, before the
    admission checks and before the request is queued (so also for requests
    then refused, answered from the cache or overloaded). Return a channel
    name from ``config.channels``, or None to let the next plugin decide. The
    first non-None answer wins; with no answer the request goes to
    ``config.routing.default``, and so does a name that is not a channel (the
    daemon logs it).
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
def dynbatchd_warmup(model: str, top_users: int, config: Config) -> WarmupJob | list[WarmupJob] | None:
    """Name inputs to precompute into the result cache before traffic needs them.

    Called by the control command ``warmup`` (``dynbatchctl warmup``, typically
    from a nightly timer or cron, off-peak), once per model: the one it names,
    else every configured model. Return a `WarmupJob`, a list of them (one
    per tenant, say) or None; every plugin's jobs are used. Only with the result cache on (``[cache] entries > 0``).

    The daemon skips inputs already cached and keeps the rest in a backlog,
    from which each scheduling pass tops up the warmup channel
    (``[cache] warmup_channel``, else ``[routing] default``) to half its
    ``queue_limit``; so warmup never fills a channel and refuses live traffic.
    They run in that channel, in batches of their own that start only on an
    idle device with no live request queued and last no longer than the
    shortest live window, and their results only fill the cache, always admitted (warmup inputs are frequent by
    choice). They are cached under (model, the job's tenant, text), so they
    serve only that tenant's requests (None: requests without a tenant); an
    isolated warmup channel caches nothing. A stop drops the backlog.

    The built-in plugin (``dynbatchd_plugins.warmup``) names the inputs the
    daemon itself observed (its top-users sketch, see `dynbatchd.topusers`),
    or those of a JSON-lines file when ``[plugins.warmup] source`` is set.
    """


# ---------------------------------------------------------------------------
# result cache
# ---------------------------------------------------------------------------

@hookspec
def dynbatchd_cache_policies() -> dict[str, Any]:
    """Register result-cache policies by name.

    Return ``{name: factory}``; ``factory(config)`` gets the whole validated
    configuration, reads the settings it needs (a policy's own keys through
    its plugin's config table, see ``dynbatchd_config_tables``: the built-in
    ``lifecycle`` policy's ``[cache] refresh_types`` and ``rare_users``) and
    returns a function from a `RequestInfo` to a `CacheRule`, which the
    daemon (and the simulator) calls once per request that has a text input
    and is not routed to an isolated channel (those are never cached).
    ``[cache] policy`` selects one (default ``lifecycle``: request type and
    user frequency steer it; ``lru``: every result kept, least recently used
    out). Called once at start; merged like window policies.
    """


# ---------------------------------------------------------------------------
# config tables
# ---------------------------------------------------------------------------

@hookspec
def dynbatchd_config_tables() -> dict[str, Any]:
    """Declare the config tables a plugin owns, so they are checked as strictly as the core's.

    Return ``{name: struct_type}``: the table ``[plugins.NAME]`` is converted to that
    msgspec struct type (best a frozen one with ``forbid_unknown_fields=True``, as
    `dynbatchd.config.Frozen`) whenever the config is validated (start, reload, check,
    tune), and a misspelt key or a value out of range is a ConfigError naming
    ``plugins.NAME.KEY`` and the rule, as a core table's would be. The plugin reads its
    settings with `dynbatchd.plugins.Plugins.table`. A name declared by two plugins is an
    error. The built-in ``warmup`` plugin declares ``[plugins.warmup]``.

    The struct may define ``check(self, config)`` for rules across keys and tables, raising
    `dynbatchd.errors.OptionError` with the key within its table. It may set a class
    attribute ``table_key`` to own, instead of ``[plugins.NAME]``, either a top-level table
    the core keeps free-form for it (only the built-in HTTP plugin's ``[http]``:
    `dynbatchd_plugins.http_config`) or the keys of a shared table beyond the core's own
    (``"routing"``, ``"compliance"``, ``"cache"``: `dynbatchd.config.shared`): the built-in
    routing plugin owns ``[routing] rules`` (`dynbatchd_plugins.routing_config`), the
    compliance plugin ``[compliance] regulated_tags`` and ``banking_max_window_ms``
    (`dynbatchd_plugins.compliance_config`), the cache plugin ``[cache] refresh_types`` and
    ``rare_users`` (`dynbatchd_plugins.cache`), all spelled as configs always had them. One
    plugin's struct per ``table_key``: two are an error. A key of a shared table that is
    neither the core's nor a loaded plugin's is refused as an unknown field. A hook that runs
    per request and reads such a table converts it once per config
    (`dynbatchd.config.PerConfig`), not per request; a hook, which has no `Plugins`, reads
    its keys of a shared table with `dynbatchd.config.plugin_table`.
    """


# ---------------------------------------------------------------------------
# front doors
# ---------------------------------------------------------------------------

@hookspec
def dynbatchd_front_doors() -> dict[str, Any]:
    """Register front doors (other ways in than the ZeroMQ socket) by name.

    Return ``{name: factory}``. At start the daemon calls ``factory(config,
    daemon_api)`` for each; a factory returns None (not configured: off) or
    an object with ``async start()`` and ``async stop()``, started with the
    daemon's other addresses (before the models load: ``api.state`` is
    ``"starting"`` until they have; a start that raises OSError stops the
    daemon's start, naming the door's ``listen`` attribute if it has one)
    and stopped after the daemon drained. `daemon_api` is a
    `dynbatchd.doors.LocalDoor`: ``await api.infer(request)`` submits a
    `dynbatchd.protocol.Request` through the same routing, compliance, cache
    and engine as a ZeroMQ request and returns its answer (``code``,
    ``message``, ``output``, ``timing``); ``api.withdraw(future)`` takes a
    request still queued back (answered ``cancelled``; a door's request of
    many inputs is all or none); ``api.stream(request)`` submits a request
    for a generative model and returns a `dynbatchd.doors.LocalStream`:
    ``async for`` yields each `dynbatchd.protocol.Chunk`, then the final
    answer, and its ``close()`` before the end withdraws the request (the
    worker frees its KV room); ``api.generative(model)`` says whether a model
    generates; ``api.state`` and ``api.models`` answer
    probes and metadata. The built-in ``http`` door serves the
    OpenAI embeddings and completions (SSE) and KServe v2 protocols
    (``[http] listen``).
    """


# ---------------------------------------------------------------------------
# model runners
# ---------------------------------------------------------------------------

@hookspec
def dynbatchd_runners() -> dict[str, Any]:
    """Register model runners by name.

    Return ``{name: runner_class}``; ``[models.NAME] runner = "..."`` selects
    one. Called in the daemon (to check names) and in each worker process (to
    build the runners); every plugin's answer is merged, and a name
    registered twice is an error.

    A runner class subclasses `dynbatchd.devices.runners.Runner`, whose
    public members are this contract (tests/project/test_docs.py checks that the two
    agree):

    ``__init__(device, options)``
        Called in the worker process with its device (``"cpu"``,
        ``"cuda:0"`` ...) and the model's ``options`` table; the base class
        keeps them as ``self.device`` and ``self.options``. Keep it cheap.
    ``load()``
        Called once, right after construction, before the worker reports
        ready: imports, weights, a warm-up run. May be slow; an exception
        fails the worker's start.
    ``check(item) -> str | None``
        Called for each input before its batch runs: a reason to refuse this
        one input (the client gets ``bad_request`` with it), or None.
    ``run(inputs, tokens) -> numpy array | list``
        Run one batch: ``inputs`` are str, numpy arrays (a tensor input) or
        plain msgpack values, ``tokens`` their token counts. Return a numpy
        array whose first axis is the batch (one raw frame; each client gets
        its row as a tensor), or a list with one output per input (each
        client gets its output as a value). Raise
        `dynbatchd.devices.runners.OutOfMemory` when the batch does not fit;
        any exception makes the worker split the batch until the inputs that
        fail alone are found, which get ``model_error``.
    ``prepare(inputs, tokens) -> prepared``
        Optional stage 1 of ``run``, for a pipelined worker
        (`dynbatchd.devices.pipeline`): the CPU work (tokenising, building
        tensors; pinned memory on CUDA), done while the device runs the batch
        before. The base class returns ``(inputs, tokens)``.
    ``forward(prepared) -> output``
        Optional stage 2: the device's work (on CUDA: copy in without
        blocking, the model, start the copy back). The base class calls
        ``run``, so a runner with only ``run`` works unchanged.
    ``finish(output) -> numpy array | list``
        Optional stage 3, done while the device runs the batch after: wait for
        the outputs and return what ``run`` would. A stage that raises sends
        the batch through ``run`` to find the failing inputs, as above.
        `dynbatchd.devices.runners.StagedRunner` makes ``run`` the three
        stages in a row.
    ``device_ns(output) -> int | None``
        Optional: the device time of a batch the runner timed itself (CUDA
        events), read after ``finish``; the base class returns None, and then
        the time ``forward`` took counts as the device time.
    ``model_directory(options) -> (path, max_tokens) | None``
        Class method, read without building the runner: the directory with the
        model's config.json that ``dynbatchctl plan`` and the daemon's
        per-device batch limits size it from, and its sequence cap. The base
        class returns the ``path`` option and ``max_tokens``; None: nothing to
        plan from (the batches are then limited by ``max_batch`` alone).
    ``sequence_cap(options) -> int | None``
        Class method: the most tokens of one request the model reads (it
        truncates the rest), so that the engine counts a request's cost and
        memory at no more; the base class returns ``max_tokens``; None: every
        token counts.
    ``own_limit(options, device) -> (items, tokens) | None``
        Class method: the batch limit on ``device`` by the runner's own account
        (0: none), which the planner then does not second-guess; the base class
        returns None (the planner decides from ``model_directory``).
    ``simulated``
        Class attribute, False by default: True when the runner models a
        device instead of running one, so every timing it causes is labelled
        simulated.

    Three optional class attributes, which the base class leaves out, let the
    daemon check ``[models.NAME] options`` at every config check, start and
    reload without building the runner (`dynbatchd.devices.runners.check_options`):
    ``OPTIONS = {name: checker}`` declares every option it reads (a checker
    returns why a value is unusable, or None; an undeclared option is a config
    error), ``REQUIRED = {name: "how to write it"}`` the ones that must be
    given, and ``NAME`` how errors call the runner. Without ``OPTIONS`` any
    option is accepted.
    """
