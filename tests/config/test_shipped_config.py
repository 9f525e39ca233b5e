"""The shipped config shows every section and key of the settings tree (the ones it leaves at their
default commented out, ``# key = value``), and uncommenting all of them still gives a valid config.
And what its defaults cannot do is said: `tune --auto` on a channel too slow for the canary."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from dynbatchd import config as cfgmod
from test_docs import config_keys

SHIPPED = Path(__file__).resolve().parents[2] / "etc" / "dynbatchd.toml"

# `# key = value`, `# [table]`, `# [[array.of.tables]]`: a setting shown commented out (one space
# after the #; a legend or prose line is indented further or is not of this shape)
COMMENTED = re.compile(r"^# ((?:[A-Za-z_][\w\-]*\s*=\s*\S.*)|(?:\[\[?[\w.\-]+\]\]?))$")


def uncommented(text: str) -> str:
    """The file with every commented-out setting switched on."""
    return "\n".join(m[1] if (m := COMMENTED.match(line)) else line for line in text.splitlines()) + "\n"


def has(data: Any, parts: list[str]) -> bool:
    """Whether `data` holds the dotted path `parts` (NAME: any key; rules[]: any item of a list)."""
    if not parts:
        return True
    head, rest = parts[0], parts[1:]
    if head.endswith("[]"):
        items = data.get(head[:-2]) if isinstance(data, dict) else None
        return isinstance(items, list) and any(has(item, rest) for item in items)
    if head == "NAME":
        return isinstance(data, dict) and any(has(v, rest) for v in data.values())
    return isinstance(data, dict) and head in data and has(data[head], rest)


def test_every_key_of_the_settings_tree_is_shown():
    data = tomllib.loads(uncommented(SHIPPED.read_text()))
    missing = sorted(path for path, _ in config_keys() if path != "source" and not has(data, path.split(".")))
    assert not missing, f"etc/dynbatchd.toml does not show: {missing}"


def test_the_file_with_every_setting_switched_on_is_valid():
    cfg = cfgmod.parse(tomllib.loads(uncommented(SHIPPED.read_text())), "etc/dynbatchd.toml, all on")
    assert cfg.http["listen"] and cfg.top_users.users and cfg.devices.ray is not None


def test_the_checker_sees_a_missing_key():
    data = tomllib.loads(uncommented("[daemon]\n# listen = \"x\"\n#   legend = not a key\n"))
    assert has(data, ["daemon", "listen"]) and not has(data, ["daemon", "legend"])
    assert has({"r": {"rules": [{"a": 1}]}}, ["r", "rules[]", "a"])
    assert not has({"c": {"x": {}}}, ["c", "NAME", "window"])


# --- tune --auto on a channel too slow for the canary --------------------------------------

def test_tune_auto_says_why_a_slow_channel_cannot_promote(monkeypatch, tmp_path):
    from test_tune_cli import FakeDaemon

    from dynbatchd.cli import dynbatchctl as ctl

    config = tmp_path / "dynbatchd.toml"
    config.write_text(SHIPPED.read_text().replace("\n[daemon]\n", f'\n[daemon]\nstate_dir = "{tmp_path}"\n', 1))
    fake = FakeDaemon(rate=20.0)   # 10% for 10 s (the defaults) of 20 req/s: ~20 requests, the canary needs 50
    monkeypatch.setattr(ctl, "control_call", fake)
    base = ["--control", "ipc:///nowhere", "--config", str(config), "tune", "--auto", "standard",
            "--candidate", "max_batch=8,window_ms=5", "--duration", "3", "--window", "0", "--canary", "replay"]
    result = CliRunner().invoke(ctl.app, base, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if "cannot promote" in line]
    assert len(lines) == 1, result.stdout
    assert "50 answered requests" in lines[0] and "below 50 req/s" in lines[0] and "--canary-seconds 30" in lines[0]
    assert not [t for t in fake.tunes if not t.get("dry_run")]   # nothing changed, no canary run
    report = json.loads(CliRunner().invoke(ctl.app, [*base, "--json"]).stdout)["channels"][0]
    assert report["outcome"] == "too_little_traffic" and "canary" not in report
    # the fix it names works: long enough, the canary runs and judges
    monkeypatch.setattr(ctl, "control_call", FakeDaemon(rate=20.0))
    longer = CliRunner().invoke(ctl.app, [*base, "--canary-seconds", "30", "--json"])
    assert json.loads(longer.stdout)["channels"][0]["outcome"] != "too_little_traffic"
