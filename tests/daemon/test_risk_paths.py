"""One risk assessment on every path, on a live daemon that has seen traffic (simulated runner,
real sockets): `tune --dry-run` prints the change and the verdict and changes nothing; a risky
`tune`, `canary start`, `reload` and `check-config --risk` are refused; `--force` applies the
change and the daemon logs that it was forced. The candidate (a 250 ms window on a channel whose
incumbent answers in a few ms) is refused on any traffic rate: its p99 is far longer."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from conftest import start_daemon
from dynbatchd.cli import dynbatchctl as ctl
from dynbatchd.client import Client, DynbatchdError

BODY = """
    [models.sim]
    runner = "simulated"
    options = { base_ms = 4.0, per_item_ms = 0.2 }
    [channels.standard]
    max_batch = 8
    window_ms = 2
    deadline_ms = 300
    queue_limit = 4096
    [routing]
    default = "standard"
"""
RISKY = ["--max-batch", "64", "--window-ms", "250"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("risk"), BODY)
    with Client(d.endpoint, timeout=30) as client:   # what the assessment fits its model to
        for _ in range(25):   # in rounds of 16: batches the daemon times, none of them late
            for f in [client.submit("sim", "x" * 40) for _ in range(16)]:
                f.result()
    yield d
    d.stop()


def cli(daemon, *args):
    return CliRunner().invoke(ctl.app, ["--control", daemon.control, "--config", str(daemon.config), *args])


def standard(daemon) -> tuple:
    c = daemon.call("config")["channels"]["standard"]
    return c["max_batch"], c["window_ms"]


def lines(daemon, pattern: str) -> list[str]:
    return [line for line in daemon.log_lines() if re.search(pattern, line)]


def test_dry_run_prints_the_change_and_the_verdict_and_changes_nothing(daemon):
    result = cli(daemon, "tune", "standard", *RISKY, "--dry-run")
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())   # (prose wraps at the terminal's width)
    assert "would change: max_batch 8 -> 64, window_ms 2.0 -> 250.0 (dry run" in said, result.output
    assert "risk refused: predicted" in said
    assert standard(daemon) == (8, 2.0) and not lines(daemon, "tune of channel")


def test_a_risky_tune_and_canary_are_refused_unless_forced(daemon):
    result = cli(daemon, "tune", "standard", *RISKY)
    said = " ".join(result.output.split())
    assert result.exit_code == 1 and "refused by the risk assessment" in said, result.output
    assert "--force" in said and standard(daemon) == (8, 2.0)
    with pytest.raises(DynbatchdError, match="refused by the risk assessment"):
        daemon.call("canary", action="start", channel="standard", max_batch=64, window_ms=250, seconds=5)
    assert "standard" not in daemon.call("canary")["running"]

    forced = cli(daemon, "tune", "standard", *RISKY, "--force")
    assert forced.exit_code == 0 and "FORCED" in forced.output, forced.output
    assert standard(daemon) == (64, 250.0)
    (line,) = lines(daemon, r"tune of channel standard by local: max_batch=8")
    assert "FORCED" in line
    assert cli(daemon, "tune", "--rollback", "standard").exit_code == 0
    assert standard(daemon) == (8, 2.0)


def test_a_risky_reload_and_check_config_are_refused_unless_forced(daemon, tmp_path):
    original = daemon.config.read_text()
    risky = original.replace("max_batch = 8\nwindow_ms = 2\n", "max_batch = 64\nwindow_ms = 250\n")
    assert risky != original
    candidate = tmp_path / "candidate.toml"
    candidate.write_text(risky)
    checked = cli(daemon, "check-config", str(candidate), "--risk")
    assert checked.exit_code == 1 and "RISK REFUSED" in checked.output, checked.output
    assert "channel standard: max_batch 8 -> 64" in checked.output
    daemon.config.write_text(risky)
    try:
        refused = cli(daemon, "reload")
        assert refused.exit_code == 1 and "refused by the risk assessment" in refused.output, refused.output
        assert standard(daemon) == (8, 2.0)
        assert cli(daemon, "reload", "--force").exit_code == 0
        assert standard(daemon) == (64, 250.0)
        (line,) = lines(daemon, "configuration reloaded by local: channels.standard.max_batch 8 -> 64")
        assert "FORCED" in line
    finally:
        daemon.config.write_text(original)
        cli(daemon, "reload", "--force")
