"""`dynbatchctl plan` with a mixed pool: one plan per device of ``devices.memory_gb``'s table, and
the same figure the live daemon gives its engine for that device."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dynbatchd import config as cfgmod
from dynbatchd.cli import plan as planmod
from dynbatchd.memory import GIB, device_limits
from dynbatchd.plugins import Plugins
from test_plan import app, llama  # noqa: F401  (llama: the model-directory fixture, shared)


@pytest.fixture
def config(tmp_path, llama, monkeypatch):
    monkeypatch.setattr(planmod, "nvml_memory", lambda index: None)
    monkeypatch.delenv("DYNBATCHD_CONFIG", raising=False)
    path = tmp_path / "dynbatchd.toml"
    path.write_text(f"""
[devices]
use = ["cuda:0", "cuda:1"]
memory_gb = {{ "cuda:0" = 80, "cuda:1" = 24 }}
[models.llama]
runner = "callable"
options = {{ target = "x:y", path = "{llama}", max_tokens = 4096 }}
[channels.standard]
max_batch = 64
window_ms = 100
""")
    return path


def invoke(*args: str):
    return CliRunner().invoke(app, ["plan", *args], env={"COLUMNS": "200"})


def test_a_table_of_memory_by_device_gives_one_plan_per_device(config):
    result = invoke("--config", str(config), "--json")
    assert result.exit_code == 0, result.output
    plans = json.loads(result.stdout)
    assert [(p["device"]["name"], p["device"]["total_bytes"]) for p in plans] == [("cuda:0", 80 * GIB),
                                                                                   ("cuda:1", 24 * GIB)]
    assert plans[0]["device"]["source"].endswith("devices.memory_gb.cuda:0")
    # 80·0.8 − 14 − 1 = 49 GiB → 98 requests of 512 MiB; 24·0.8 − 14 − 24·0.05 = 4 GiB → 8.
    assert [p["memory"]["max_batch"] for p in plans] == [98, 8]
    assert [p["channels"][0]["status"] for p in plans] == ["fits", "lower to 8"]
    # The live daemon sizes each device's batches with the same arithmetic.
    cfg = cfgmod.load(config)
    assert [lim.items for lim in device_limits(cfg, ["cuda:0", "cuda:1"], Plugins.load().runners())] == [98, 8]


def test_the_tables_show_each_device_and_memory_gb_still_plans_one(config):
    result = invoke("--config", str(config))
    assert result.exit_code == 0, result.output
    assert "on cuda:0 80.00 GiB" in result.stdout and "on cuda:1 24.00 GiB" in result.stdout
    one = json.loads(invoke("--config", str(config), "--memory-gb", "40", "--json").stdout)
    assert isinstance(one, dict) and one["device"]["source"] == "--memory-gb"


def test_a_third_party_runner_is_planned_from_the_model_directory_it_names(llama):
    """A runner the project does not ship, with a ``path`` option, is sized as a built-in one is;
    one that says it has no config.json (``model_directory`` None) runs unlimited."""
    from dynbatchd.devices.runners import Runner

    class Mine(Runner):
        OPTIONS = {"path": str, "max_tokens": int}

    class Opaque(Mine):
        @classmethod
        def model_directory(cls, options):
            return None

    raw = {"devices": {"use": ["cuda:0"], "memory_gb": {"cuda:0": 80}},
           "channels": {"standard": {"max_batch": 64, "window_ms": 100}}}
    for name, expected in (("mine", 98), ("opaque", 0)):
        cfg = cfgmod.parse({**raw, "models": {"m": {"runner": name, "options": {"path": str(llama), "max_tokens": 4096}}}})
        assert [lim.items for lim in device_limits(cfg, ["cuda:0"], {"mine": Mine, "opaque": Opaque})] == [expected]
