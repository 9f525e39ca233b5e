"""The control plane's records and replies. Who started a canary, and its risk verdict, are
recorded once the canary runs: a second start refused as "already running" once overwrote the
running canary's record, so its promotion wrote the refused start's author and verdict into the
drop-in's trail. An unknown channel or model a command names is quoted short in its error."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dynbatchd import config as cfgmod
from dynbatchd.canary_operations import CanaryOperations
from dynbatchd.plugins import Plugins


class OneSplitEngine:
    """Runs one canary; a second start is refused, as the engine refuses it."""

    def __init__(self):
        self.running: dict[str, object] = {}

    def start_split(self, channel, built, judge, shadow=False):
        if channel in self.running:
            raise ValueError(f"a canary of channel {channel!r} is already running")
        self.running[channel] = judge

    def splits_running(self):
        return {}


def verdict(text: str):
    return SimpleNamespace(accepted=True, reason="", verdict=lambda: text, as_dict=lambda: {})


def test_a_refused_second_start_leaves_the_running_canarys_record_as_it_was():
    config = cfgmod.parse({"models": {"m": {"runner": "noop"}},
                           "channels": {"c": {"max_batch": 4, "window_ms": 1, "deadline_ms": 1000}},
                           "routing": {"default": "c"}}, "test")
    verdicts = iter(["ok (assessed on 500 requests)", "not assessed: 0 requests"])

    async def assess(changes):
        return {"c": verdict(next(verdicts))}

    daemon = SimpleNamespace(config=config, plugins=Plugins.load(), engine=OneSplitEngine(), clock=lambda: 0,
                             _schedule_pump=lambda: None)
    daemon.operations = SimpleNamespace(check_channel_still_there=lambda channel: None, assess=assess)
    canaries = CanaryOperations(daemon)
    asyncio.run(canaries.start_checked("c", {"window_ms": 2}, 0.1, 60, False, by="alice"))
    with pytest.raises(ValueError, match="already running"):
        asyncio.run(canaries.start_checked("c", {"window_ms": 3}, 0.1, 60, False, by="mallory"))
    assert canaries.canary_by["c"] == {"by": "alice", "risk": "ok (assessed on 500 requests)", "forced": False}
    assert canaries.canary_changes["c"] == {"window_ms": 2}


@pytest.mark.parametrize("command, args", [("tune", {"channel": "x" * 100_000, "max_batch": 2}),
                                           ("canary", {"action": "start", "channel": "x" * 100_000, "max_batch": 2}),
                                           ("warmup", {"model": "x" * 100_000})])
def test_an_unknown_name_of_100_kb_is_quoted_short_in_the_error(command, args):
    """An error reply once echoed a client's 100 kB channel or model name whole."""
    from dynbatchd.control.commands import COMMANDS, CommandError

    config = cfgmod.parse({"models": {"m": {"runner": "noop"}},
                           "channels": {"c": {"max_batch": 4, "window_ms": 1, "deadline_ms": 1000}},
                           "routing": {"default": "c"}}, "test")
    daemon = SimpleNamespace(config=config, state="serving", cache=object())
    with pytest.raises(CommandError) as refused:
        COMMANDS[command](daemon, **args)
    assert str(refused.value).startswith("no ") and len(str(refused.value)) < 80, str(refused.value)[:200]
