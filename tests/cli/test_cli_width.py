"""Every dynbatchctl command's human output fits 80 columns (COLUMNS=80), nothing cut mid-value,
the most important columns kept; ``--wide`` shows every column. Offline paths, or a fake daemon."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.cells import cell_len
from typer.testing import CliRunner

from dynbatchd.cli import dynbatchctl as ctl

SHIPPED = Path(__file__).resolve().parents[2] / "etc" / "dynbatchd.toml"
runner = CliRunner()


def invoke(*args: str, columns: int = 80):
    result = runner.invoke(ctl.app, ["--control", "ipc:///nowhere", "--config", str(SHIPPED), *args],
                           env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    return result.stdout


def assert_fits(text: str, width: int = 80) -> None:
    """Every line within `width` cells and no value cut short ("…"). A line that is one bare path is
    left whole (it is copied, not read), and is the only thing allowed past the edge."""
    assert text.strip(), "no output"
    for line in text.splitlines():
        if line.startswith("/") and " " not in line.strip():
            continue
        assert cell_len(line) <= width, f"{cell_len(line)} columns: {line!r}\n{text}"
    assert "…" not in text, text


def widest(text: str) -> int:
    return max(cell_len(line) for line in text.splitlines())


def test_capacity_fits_and_keeps_the_monthly_cost():
    text = invoke("capacity", "--requests-per-day", "1M", "--duration", "2")
    assert_fits(text)
    assert "monthly cost" in text and "$2,920" in text      # one h100 unit at $4.00/h for 730 h
    wide = invoke("capacity", "--requests-per-day", "1M", "--duration", "2", "--wide")
    for header in ("device ms/request", "price", "searched", "unbatched p99", "1×$4.00×730h"):
        assert header in wide, header
    assert "hidden" not in wide and widest(wide) > 80


def test_simulate_fits_and_wide_shows_every_column():
    text = invoke("simulate", "--duration", "2", "--rate", "200")
    assert_fits(text)
    for header in ("channel", "on time", "p99 ms"):
        assert header in text
    wide = invoke("simulate", "--duration", "2", "--rate", "200", "--wide")
    for header in ("offered", "p50 ms", "p99 ms", "expired", "overloaded", "mean batch"):
        assert header in wide, header
    assert "hidden" not in wide


def test_recommend_fits(monkeypatch):
    from test_cli_recommend import fake_daemon, observed

    fake_daemon(monkeypatch, observed(600.0, 50.0), max_batch=4, window_ms=10.0)
    text = invoke("recommend", "--duration", "1")
    assert_fits(text)
    for header in ("channel", "now", "recommended", "then on time"):
        assert header in text
    wide = invoke("recommend", "--duration", "1", "--wide")
    assert "then p99 ms" in wide and "hidden" not in wide


def test_plan_fits():
    assert_fits(invoke("plan", "--memory-gb", "24"))


def test_tune_auto_table_fits(monkeypatch, tmp_path):
    from test_tune_cli import FakeDaemon

    config = tmp_path / "dynbatchd.toml"
    config.write_text(SHIPPED.read_text().replace("\n[daemon]\n", f'\n[daemon]\nstate_dir = "{tmp_path}"\n', 1))
    monkeypatch.setattr(ctl, "control_call", FakeDaemon())
    args = ["--control", "ipc:///nowhere", "--config", str(config), "tune", "--auto", "standard", "--trials", "8",
            "--duration", "1", "--canary-seconds", "1", "--window", "0", "--canary", "replay"]
    result = runner.invoke(ctl.app, args, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert_fits(result.stdout)
    for header in ("batch", "window ms", "on time", "p99 ms"):
        assert header in result.stdout
    monkeypatch.setattr(ctl, "control_call", FakeDaemon())
    wide = runner.invoke(ctl.app, [*args, "--wide"], env={"COLUMNS": "80"}).stdout
    assert "device s" in wide and "on-time rps" in wide


def test_bench_table_fits(tmp_path):
    args = ["bench", "--simulated", "--concurrency", "10,50", "--max-batch", "8", "--window-ms", "10",
            "--duration-s", "0.3", "--warmup-s", "0", "--db", str(tmp_path / "t.sqlite"), "--out", str(tmp_path)]
    assert_fits(invoke(*args))
    assert_fits(invoke("bench", "--history", "--db", str(tmp_path / "t.sqlite")))


def test_status_fits(monkeypatch):
    from test_cli_config_ctl import status_data

    monkeypatch.setattr(ctl, "control_call", lambda endpoint, cmd, **a: status_data())
    assert_fits(invoke("status"))


@pytest.mark.parametrize("command", ["capacity", "simulate", "recommend", "tune", "bench", "status"])
def test_every_table_command_has_wide(command):
    import typer

    params = typer.main.get_command(ctl.app).commands[command].params
    assert any("--wide" in getattr(p, "opts", ()) for p in params), f"{command} has no --wide"


# --- help texts: a [section] is printed, not eaten as rich markup ------------------------------

def every_command(group, path=()):
    import click

    for name, cmd in group.commands.items():
        yield (*path, name), cmd
        if isinstance(cmd, click.Group):
            yield from every_command(cmd, (*path, name))


def test_help_texts_keep_their_bracketed_words():
    """`[top_users]` in a help text is a config section to the reader and a rich style tag to typer,
    which drops it ("from what the daemon observed (its  sketch)"): every help shows its own."""
    import re

    import typer

    eaten = []
    for path, cmd in every_command(typer.main.get_command(ctl.app)):
        raw = " ".join(filter(None, [cmd.help, *(getattr(p, "help", None) for p in cmd.params)]))
        words = set(re.findall(r"(?<!\\)\[[\w.]+\]", raw)) | {w[1:] for w in re.findall(r"\\\[[\w.]+\]", raw)}
        shown = " ".join(runner.invoke(ctl.app, [*path, "--help"], env={"COLUMNS": "300"}).stdout.split())
        eaten += [f"{' '.join(path)}: {w}" for w in sorted(words) if w not in shown]
    assert not eaten, f"bracketed words missing from --help: {eaten}"


def test_warmup_and_simulate_help_read_as_sentences():
    warmup = " ".join(runner.invoke(ctl.app, ["warmup", "--help"], env={"COLUMNS": "300"}).stdout.split())
    assert "(its [top_users] sketch)" in warmup and "from [plugins.warmup] source" in warmup
    simulate = " ".join(runner.invoke(ctl.app, ["simulate", "--help"], env={"COLUMNS": "300"}).stdout.split())
    assert "those [devices] use names" in simulate
