"""The monthly recalibration units: tune --auto against a running daemon only, the options dynbatchctl
has, a monthly persistent timer, and the README's cron line the same command at the same time."""

from __future__ import annotations

import re
from pathlib import Path

import typer.main

from dynbatchd.cli import dynbatchctl

UNITS = Path(__file__).resolve().parents[2] / "systemd"
SERVICE, TIMER, README = UNITS / "dynbatchd-tune.service", UNITS / "dynbatchd-tune.timer", UNITS / "README.md"


def value(unit: Path, key: str) -> str:
    found = [line.split("=", 1)[1].strip() for line in unit.read_text().splitlines() if line.startswith(key + "=")]
    assert found, f"{unit.name} has no {key}="
    return found[-1]


def test_the_service_runs_tune_auto_with_options_dynbatchctl_has():
    assert value(SERVICE, "Type") == "oneshot" and value(SERVICE, "Requisite") == "dynbatchd.service"
    argv = value(SERVICE, "ExecStart").split()
    assert Path(argv[0]).name == "dynbatchctl"
    top, _, sub = " ".join(argv[1:]).partition(" tune")
    cli = typer.main.get_command(dynbatchctl.app)

    def opts(command):
        return {o for p in command.params for o in getattr(p, "opts", ())}
    assert "--auto" in sub.split()
    assert {a for a in top.split() if a.startswith("-")} <= opts(cli)
    assert {a for a in sub.split() if a.startswith("-")} <= opts(cli.commands["tune"])
    assert value(SERVICE, "StateDirectory") == "dynbatchd", "the history lives in the daemon's state directory"


def test_the_timer_is_monthly_and_persistent():
    assert re.fullmatch(r"\*-\*-01 \d\d:\d\d:00", value(TIMER, "OnCalendar"))
    assert value(TIMER, "Persistent") in ("true", "yes") and value(TIMER, "Unit") == SERVICE.name


def test_the_readme_cron_line_is_the_timer_and_the_service():
    (block,) = re.findall(r"```crontab\n(.*?)```", README.read_text(), re.DOTALL)
    minute, hour, dom, month, dow, user, *command = block.split()
    hh, mm = re.fullmatch(r"\*-\*-01 (\d\d):(\d\d):00", value(TIMER, "OnCalendar")).groups()
    assert (int(minute), int(hour), dom, month, dow) == (int(mm), int(hh), "1", "*", "*")
    assert user == "root" and command == value(SERVICE, "ExecStart").split()
