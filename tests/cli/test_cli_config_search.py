"""One config search order for every command: --config, $DYNBATCHD_CONFIG, ./etc/dynbatchd.toml, /etc/dynbatchd."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dynbatchd import config as cfgmod
from dynbatchd.cli import dynbatchctl as ctl, plan as planmod
from dynbatchd.cli.dynbatchd import app as daemon_app

REPO = Path(__file__).resolve().parents[2]
SHIPPED = (REPO / "etc" / "dynbatchd.toml").read_text()


def config_with_control(path: Path, control: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SHIPPED.replace("[daemon]\n", f'[daemon]\ncontrol = "{control}"\n', 1))
    return path


@pytest.fixture
def places(tmp_path, monkeypatch):
    """A working directory with ./etc/dynbatchd.toml, a stand-in for /etc/dynbatchd, and no $DYNBATCHD_CONFIG."""
    monkeypatch.delenv("DYNBATCHD_CONFIG", raising=False)
    monkeypatch.setattr(planmod, "nvml_memory", lambda index: None)
    work = tmp_path / "work"
    local = config_with_control(work / "etc" / "dynbatchd.toml", "ipc:///local")
    system = config_with_control(tmp_path / "system" / "dynbatchd.toml", "ipc:///system")
    monkeypatch.chdir(work)
    monkeypatch.setattr(cfgmod.paths, "DEFAULT_CONFIG_PATHS", ("etc/dynbatchd.toml", str(system)))
    return {"local": local, "system": system, "explicit": config_with_control(tmp_path / "x.toml", "ipc:///explicit"),
            "env": config_with_control(tmp_path / "env.toml", "ipc:///env"), "work": work}


def test_the_order_is_explicit_then_environment_then_local_then_system(places, monkeypatch):
    assert cfgmod.find_config(places["explicit"]) == places["explicit"]
    monkeypatch.setenv("DYNBATCHD_CONFIG", str(places["env"]))
    assert cfgmod.find_config(places["explicit"]) == places["explicit"]
    assert cfgmod.find_config(None) == places["env"]
    monkeypatch.delenv("DYNBATCHD_CONFIG")
    assert cfgmod.find_config(None) == Path("etc/dynbatchd.toml")
    places["local"].unlink()
    assert cfgmod.find_config(None) == places["system"]
    places["system"].unlink()
    assert cfgmod.find_config(None) is None


def test_an_explicit_or_environment_file_that_is_missing_is_not_skipped(places, monkeypatch):
    assert cfgmod.find_config(places["work"] / "nope.toml") == places["work"] / "nope.toml"
    monkeypatch.setenv("DYNBATCHD_CONFIG", "/nope.toml")
    assert cfgmod.find_config(None) == Path("/nope.toml")


def control_seen(monkeypatch) -> list[str]:
    seen: list[str] = []

    def fake(endpoint, cmd, **args):
        seen.append(endpoint)
        return {"needs_restart": []}

    monkeypatch.setattr(ctl, "control_call", fake)
    return seen


@pytest.mark.parametrize("use, expected", [("explicit", "ipc:///explicit"), ("env", "ipc:///env"),
                                           ("local", "ipc:///local"), ("system", "ipc:///system")])
def test_dynbatchctl_finds_its_endpoints_in_that_order(places, monkeypatch, use, expected):
    seen = control_seen(monkeypatch)
    args = ["reload"]
    if use == "explicit":
        args = ["--config", str(places["explicit"]), "reload"]
    elif use == "env":
        monkeypatch.setenv("DYNBATCHD_CONFIG", str(places["env"]))
    elif use == "system":
        places["local"].unlink()
    result = CliRunner().invoke(ctl.app, args)
    assert result.exit_code == 0, result.output
    assert seen == [expected]


def test_endpoint_flags_need_no_config_file(places, monkeypatch):
    seen = control_seen(monkeypatch)
    places["local"].write_text("not toml [")
    result = CliRunner().invoke(ctl.app, ["--control", "ipc:///flag", "reload"])
    assert result.exit_code == 0, result.output
    assert seen == ["ipc:///flag"]


def test_the_global_config_reaches_simulate_and_plan(places):
    x = str(places["explicit"])
    sim = CliRunner().invoke(ctl.app, ["--config", x, "simulate", "--rate", "50", "--duration", "1", "--json"])
    assert sim.exit_code == 0, sim.output
    assert json.loads(sim.stdout)["config"] == x
    plan = CliRunner().invoke(ctl.app, ["--config", x, "plan", "--memory-gb", "8", "--json"])
    assert plan.exit_code == 0, plan.output
    assert json.loads(plan.stdout)["config"] == x


def test_a_command_s_own_config_wins_over_the_global_one(places):
    own = str(places["env"])
    result = CliRunner().invoke(ctl.app, ["--config", str(places["explicit"]), "simulate", "--config", own,
                                          "--rate", "50", "--duration", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["config"] == own


def test_simulate_and_plan_follow_the_environment_then_the_local_file(places, monkeypatch):
    monkeypatch.setenv("DYNBATCHD_CONFIG", str(places["env"]))
    for args in (["simulate", "--rate", "50", "--duration", "1", "--json"], ["plan", "--memory-gb", "8", "--json"]):
        result = CliRunner().invoke(ctl.app, args)
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["config"] == str(places["env"])
    monkeypatch.delenv("DYNBATCHD_CONFIG")
    for args in (["simulate", "--rate", "50", "--duration", "1", "--json"], ["plan", "--memory-gb", "8", "--json"]):
        result = CliRunner().invoke(ctl.app, args)
        assert json.loads(result.stdout)["config"] == "etc/dynbatchd.toml"


def test_check_config_without_a_file_checks_the_one_start_would_read(places, monkeypatch):
    result = CliRunner().invoke(daemon_app, ["check-config"])
    assert result.exit_code == 0 and "etc/dynbatchd.toml" in result.output, result.output
    monkeypatch.setenv("DYNBATCHD_CONFIG", str(places["work"] / "missing.toml"))
    result = CliRunner().invoke(daemon_app, ["check-config"])
    assert result.exit_code == 2 and "missing.toml" in result.output


def test_no_file_anywhere_is_one_line_and_exit_2(places):
    places["local"].unlink()
    places["system"].unlink()
    for app, args in ((daemon_app, ["start"]), (daemon_app, ["check-config"]), (ctl.app, ["simulate"])):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert "no config file found" in result.output and "$DYNBATCHD_CONFIG" in result.output


def test_the_search_order_is_documented_once_in_dynbatchctl_1_and_the_readme():
    page = (REPO / "man" / "dynbatchctl.1.rst").read_text()
    section = page.split("CONFIGURATION FILE\n==================\n", 1)[1].split("\n====", 1)[0]
    order = [section.index(s) for s in ("**--config**", "``$DYNBATCHD_CONFIG``", "``./etc/dynbatchd.toml``",
                                         "``/etc/dynbatchd/dynbatchd.toml``")]
    assert order == sorted(order)
    readme = " ".join((REPO / "README.md").read_text().split())
    assert ("its `--config` (`dynbatchctl --config FILE COMMAND` counts for every command), `$DYNBATCHD_CONFIG`, "
            "`./etc/dynbatchd.toml`, `/etc/dynbatchd/dynbatchd.toml`") in readme
