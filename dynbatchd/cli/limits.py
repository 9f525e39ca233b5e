"""The one check of dynbatchctl's numbers: finite, and no larger than a run can finish with.

click's ranges take ``inf`` (it is >= any minimum) and ``nan`` (no comparison fails), and an
offline command given ``--rate inf`` or ``--duration 1e308`` loops forever while memory grows.
`guard` puts `check` on every numeric option of every command (`output.OneLineErrors` calls it
as it hands out a command), so no command can forget; values parsed from text (``--rates``,
``--requests-per-day``) and products of several (`check_volume`) call it themselves. A breach is
a usage error: one ``error:`` line naming the option, exit 2. dynbatchctl(1) lists the bounds.
"""

from __future__ import annotations

import math
from typing import Any

import typer

DAY_S = 86_400.0
# The most each option takes (the least is the option's own `min`). An option not named here:
# any finite float, any int that 64 bits carry (msgpack, SQLite).
MOST: dict[str, float] = {
    "--rate": 100_000.0,               # requests per second, simulated
    "--rates": 100_000.0,
    "--concurrency": 100_000.0,
    "--duration": 3_600.0,             # simulated seconds
    "--duration-s": 3_600.0,
    "--warmup-s": 3_600.0,
    "--devices": 4_096.0,              # as capacity's search
    "--requests-per-day": 1e10,
    "--peak-factor": 100.0,
    "--compress": 1e6,
    "--memory-gb": 1_048_576.0,        # 1 PiB
    "--reserve-gb": 1_048_576.0,
    "--seq-len": 10_000_000.0,
    "--tokens": 10_000_000.0,
    "--max-new-tokens": 10_000_000.0,
    "--gpu": 1_023.0,
    "--trials": 10_000.0,
    "--timeout": DAY_S,
    "--watch": DAY_S,
    "--window": DAY_S,
    "--canary-seconds": DAY_S,
    "--deadline-ms": DAY_S * 1000,
}
# Requests one simulated run (a trial of capacity, a cell of bench) may hold: about 30 s of work.
MOST_REQUESTS = 1_000_000
# Simulated seconds a trace replay may span (its last time / --compress): the simulator observes its
# channels every simulated second, so a span of 1e14 s (two rows far apart) would never end; 1e7 s
# (116 days) is about half a minute of that.
MOST_TRACE_SPAN_S = 1e7
INT_MOST = 2**63 - 1
# Must be above 0 (the option's own `min` cannot say "> 0" for a float).
POSITIVE = {"--timeout"}
# Options a command checks as config values (`config.check_channel_values`: the ranges of a config
# file, inf and nan refused), with an error naming the config key: not checked twice.
CONFIG_CHECKED = {"tune": {"--max-batch", "--window-ms", "--deadline-ms", "--queue-limit", "--max-tokens",
                           "--min-share", "--long-share"}}


def check(option: str, value: Any) -> Any:
    """`value` if `option` may take it; else the usage error naming the option."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad(option, f"must be a finite number, got {value!r}")
    most = MOST.get(option, INT_MOST)
    if abs(value) > most:
        raise _bad(option, f"at most {most:,.15g}, got {value:g}")
    if option in POSITIVE and value <= 0:
        raise _bad(option, f"must be above 0, got {value:g}")
    return value


def check_volume(rate_rps: float, seconds: float, what: str) -> None:
    """Refuse a run of more than MOST_REQUESTS simulated requests (`what` names the options)."""
    if rate_rps * seconds > MOST_REQUESTS:
        raise _bad(what, f"{rate_rps:,.6g} req/s × {seconds:g} s is {rate_rps * seconds:,.0f} simulated requests; "
                         f"at most {MOST_REQUESTS:,} a run")


def guard(command: Any) -> Any:
    """`command` (a group: each of its commands) with `check` on each numeric option; idempotent."""
    if getattr(command, "_limits_guarded", False):
        return command
    command._limits_guarded = True
    for sub in getattr(command, "commands", {}).values():
        guard(sub)
    skip = CONFIG_CHECKED.get(command.name, set())
    for param in command.params:   # every one: `check` passes what is not a number
        option = max(param.opts, key=len)
        if option not in skip:
            param.callback = _checking(param.callback, option)
    return command


def _checking(callback: Any, option: str) -> Any:
    def checked(ctx: Any, param: Any, value: Any) -> Any:
        if value is not None:
            for one in value if isinstance(value, (list, tuple)) else (value,):
                check(option, one)
        return callback(ctx, param, value) if callback is not None else value
    return checked


def _bad(option: str, rule: str) -> typer.BadParameter:
    return typer.BadParameter(rule, param_hint=f"'{option}'")
