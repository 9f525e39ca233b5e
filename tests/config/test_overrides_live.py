"""Tuning that persists, on a live daemon (simulated runner, real sockets): a manual tune goes to
the drop-in and shows in `status`; a reload keeps it unless the file changed that key (then the
file wins, said in one log line); a restart applies it again; `tune --rollback` steps back; a
drop-in that no longer validates is refused in one log line and the daemon starts on the file.
Every tune and reload logs exactly one line."""

from __future__ import annotations

import json
import re

from typer.testing import CliRunner

from conftest import start_daemon
from dynbatchd.cli import dynbatchctl as ctl

BODY = """
    [models.sim]
    runner = "simulated"
    options = { base_ms = 2.0, per_item_ms = 0.1 }
    [channels.standard]
    max_batch = 8
    window_ms = 5
    deadline_ms = 1000
    [routing]
    default = "standard"
"""


def cli(daemon, *args):
    result = CliRunner().invoke(ctl.app, ["--control", daemon.control, "--config", str(daemon.config), *args])
    return result


def lines(daemon, pattern: str) -> list[str]:
    return [line for line in daemon.log_lines() if re.search(pattern, line)]


def standard(daemon) -> dict:
    return daemon.call("config")["channels"]["standard"]


def test_a_tune_persists_across_reload_and_restart_and_rolls_back(tmp_path):
    daemon = start_daemon(tmp_path, BODY)
    try:
        assert cli(daemon, "tune", "standard", "--max-batch", "4", "--window-ms", "2").exit_code == 0
        drop_in = tmp_path / "state" / "overrides.toml"
        assert "max_batch = { value = 4" in drop_in.read_text()
        shown = daemon.status()["overrides"]["standard"]
        assert shown["max_batch"]["by"] == "local" and shown["window_ms"]["value"] == 2.0
        status = cli(daemon, "status", "--wide")
        assert "tuned standard: max_batch=4, window_ms=2 (by local since" in status.output, status.output

        assert cli(daemon, "reload").exit_code == 0
        assert (standard(daemon)["max_batch"], standard(daemon)["window_ms"]) == (4, 2.0)

        daemon.config.write_text(daemon.config.read_text().replace("window_ms = 5", "window_ms = 7"))
        reloaded = json.loads(cli(daemon, "reload", "--json").output)
        assert reloaded["dropped_overrides"] == ["channels.standard.window_ms"]
        assert (standard(daemon)["max_batch"], standard(daemon)["window_ms"]) == (4, 7.0)
        assert len(lines(daemon, "overrides dropped.*channels.standard.window_ms")) == 1
        assert len(lines(daemon, "tune of channel standard")) == 1
        assert len(lines(daemon, "configuration reloaded")) == 2
        assert cli(daemon, "tune", "standard", "--max-batch", "6").exit_code == 0
    finally:
        daemon.stop()

    again = start_daemon(tmp_path, BODY.replace("window_ms = 5", "window_ms = 7"))
    try:
        assert (standard(again)["max_batch"], standard(again)["window_ms"]) == (6, 7.0)
        assert cli(again, "tune", "--rollback", "standard").exit_code == 0
        assert standard(again)["max_batch"] == 4
        assert cli(again, "tune", "--rollback", "standard").exit_code == 0
        assert standard(again)["max_batch"] == 8   # the file's: no earlier tune is left
        refused = cli(again, "tune", "--rollback", "standard")
        assert refused.exit_code == 1 and "nothing to restore" in refused.output
        assert len(lines(again, "tune of channel standard")) == 2
        assert "[channels.standard]" not in drop_in.read_text()   # nothing overridden; the trail stays
    finally:
        again.stop()


def test_a_drop_in_that_no_longer_validates_is_refused_and_ignored(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "overrides.toml").write_text(
        '[channels.standard]\nwindow_ms = { value = 5000.0, since = 2025-01-01T00:00:00Z, by = "alice" }\n')
    daemon = start_daemon(tmp_path, BODY)
    try:
        assert standard(daemon)["window_ms"] == 5.0
        (refusal,) = lines(daemon, "drop-in")
        assert "refused and ignored" in refusal and "channels.standard.window_ms" in refusal
        assert daemon.status()["overrides"] == {}
    finally:
        daemon.stop()


def test_long_share_is_tuned_live_and_checked_like_the_file(tmp_path):
    daemon = start_daemon(tmp_path, BODY)
    try:
        assert standard(daemon)["long_share"] == 0.9   # the default: long requests keep their share
        assert cli(daemon, "tune", "standard", "--long-share", "0").exit_code == 0
        assert standard(daemon)["long_share"] == 0.0
        assert "long_share = { value = 0.0" in (tmp_path / "state" / "overrides.toml").read_text()
        refused = cli(daemon, "tune", "standard", "--long-share", "1.5")
        assert refused.exit_code != 0 and "channels.standard.long_share" in refused.output, refused.output
        assert standard(daemon)["long_share"] == 0.0
        assert daemon.status()["channels"]["standard"]["end_slip_ms"] >= 0.0
        assert daemon.status()["channels"]["standard"]["long_price"] >= 0.0
    finally:
        daemon.stop()
