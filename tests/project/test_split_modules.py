"""Issue 25's splits keep every old import path, and the built-in policies reach the scheduler
through the same registry as a plugin's.

Pure: imports and the scheduler's registries, no daemon and no clock.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from dynbatchd.config import ChannelSettings, PolicySettings
from dynbatchd.plugins import Plugins
from dynbatchd.scheduler import build_channels, sizing, windows
from dynbatchd.scheduler.policies import FixedWindow

ROOT = Path(__file__).resolve().parents[2]

# module -> names other modules, tests, benchmarks and the README import from it
OLD_PATHS = {
    "dynbatchd.transport": ["FrontEnd", "CurveServer", "LoopSocket", "Message", "ADMIN", "CLIENT", "_Throttle",
                            "bind", "ipc_file_of", "remove_ipc_file", "_ipc_in_use", "split_envelope", "validate"],
    "dynbatchd.client": ["Client", "AsyncClient", "CurveKeys", "DynbatchdError", "BadRequest", "ModelError",
                         "Overloaded", "DeadlineExceeded", "Refused", "QuotaExceeded", "Timeout", "ClientClosed",
                         "NotRunning", "ERRORS", "DEFAULT_TIMEOUT_S", "build_request", "parse_reply",
                         "control_call"],
    "dynbatchd.telemetry": ["NvmlProbe", "Histogram", "ChannelStats", "daemon_health", "scheduling_efficiency"],
    "dynbatchd.scheduler.windows": ["EwmaWindow", "PatternWindow", "SloWindow", "TieredWindow", "factories",
                                    "DEFAULT_TIERS", "SECOND"],
    "dynbatchd.scheduler.channel": ["Channel", "Item", "Batch", "Lane", "NEVER"],
    "dynbatchd_plugins.http": ["HttpDoor", "SUBMIT_CHUNK", "HttpError", "STATUS", "ROUTES", "request_id"],
    "dynbatchd_plugins.bandit": ["BanditWindow", "_Stats"],
}


@pytest.mark.parametrize("module", sorted(OLD_PATHS))
def test_every_name_is_still_where_callers_import_it(module):
    found = importlib.import_module(module)
    assert [name for name in OLD_PATHS[module] if not hasattr(found, name)] == []


def test_telemetry_names_nvml_without_importing_it():
    """telemetry is a leaf the scheduler may import: NvmlProbe is reached late, from dynbatchd.nvml."""
    from dynbatchd import nvml, telemetry

    assert telemetry.NvmlProbe is nvml.NvmlProbe
    tree = ast.parse((ROOT / "dynbatchd" / "telemetry.py").read_text())
    assert not [n for n in tree.body if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("dynbatchd")]


@pytest.mark.parametrize("module", ["listeners", "doors"])
def test_listeners_and_doors_never_name_the_service(module):
    """Not even for annotations (the circle issue 25 breaks): they name the DaemonHost protocol."""
    text = (ROOT / "dynbatchd" / f"{module}.py").read_text()
    assert "dynbatchd.service" not in text and "DaemonHost" in text


def test_the_builtin_plugins_register_the_schedulers_own_tables():
    """Each built-in policy's code is in the scheduler, and the plugins register exactly its tables:
    one home per policy (bandit's used to be plugins/bandit.py)."""
    plugins = Plugins.load()
    assert plugins.window_policies() == windows.factories()
    assert plugins.batch_sizers() == sizing.factories()
    assert {"fixed", "ewma", "pattern", "tiered", "slo", "bandit"} == set(windows.factories())
    assert {"static", "adaptive"} == set(sizing.factories())


def test_a_registry_may_replace_a_builtin_by_name():
    """fixed is an entry of the registry like any other: a plugin's entry of that name wins."""
    class Halved(FixedWindow):
        pass

    made = []
    registry = {"fixed": lambda name, settings, options: made.append(name) or Halved(settings.window_ms / 2)}
    built = build_channels({"c": ChannelSettings(max_batch=4, window_ms=10)}, registry)
    assert made == ["c"] and isinstance(built["c"].window, Halved)


def test_without_a_registry_every_builtin_is_there():
    settings = {name: ChannelSettings(max_batch=4, window_ms=10, window=PolicySettings(policy=name))
                for name in windows.factories()}
    built = build_channels(settings)
    assert {name: channel.describe()["policy"] for name, channel in built.items()} == {n: n for n in settings}
