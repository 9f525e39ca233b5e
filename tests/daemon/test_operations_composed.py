"""The daemon holds its operations (issue 25: composed, not a mixin): an in-process `Daemon`, no
sockets, whose control commands reach `daemon.operations` and `daemon.membership`."""

from __future__ import annotations

import tomllib

from dynbatchd.config.reading import parse
from dynbatchd.control import commands
from dynbatchd.membership import Membership
from dynbatchd.operations import Operations
from dynbatchd.plugins import Plugins
from dynbatchd.service import Daemon

CONFIG = """
[models.sim]
runner = "simulated"
[channels.standard]
max_batch = 8
window_ms = 1
[daemon]
state_dir = "{state}"
"""


def daemon(tmp_path) -> Daemon:
    return Daemon(parse(tomllib.loads(CONFIG.format(state=tmp_path))), Plugins.load())


def test_the_daemon_inherits_nothing_and_holds_its_operations(tmp_path):
    assert Daemon.__bases__ == (object,)
    d = daemon(tmp_path)
    assert isinstance(d.operations, Operations) and d.operations.daemon is d
    assert isinstance(d.membership, Membership) and d.membership.daemon is d
    assert set(d.membership.model_specs) == {"sim"} and not d.membership.loading_models
    assert d.operations.file_config.source == d.config.source   # the file, before the (empty) drop-in


def test_the_control_commands_reach_the_operations(tmp_path):
    d = daemon(tmp_path)
    status = commands.status(d)
    assert status["daemon"]["state"] == "starting" and set(status["channels"]) == {"standard"}
    assert status["models"] == {"serving": ["sim"], "loading": [], "unloading": [], "failed": {}}
    assert {"quotas", "tenants", "generation", "overrides", "canary"} <= set(status)   # one status, whole
    assert "dynbatchd_" in d.operations.metrics_page()
    assert commands.config(d)["http"]["listen"] == ""   # the HTTP plugin's table, defaults filled in
    assert commands.stop(d) == {"state": "draining"} and d._stop.is_set()
