"""`dynbatchctl simulate`: capacity planning from a config, offline and deterministic."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from dynbatchd.cli.dynbatchctl import app

SHIPPED = str(Path(__file__).resolve().parents[2] / "etc" / "dynbatchd.toml")


def run(*args: str) -> dict:
    result = CliRunner().invoke(app, ["simulate", "--config", SHIPPED, "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_light_load_is_served_on_time_and_every_request_is_accounted_for():
    data = run("--rate", "200", "--duration", "3")
    assert data["simulated"] is True
    assert sum(c["offered"] for c in data["channels"].values()) == data["requests"]
    assert set(data["channels"]) == {"realtime", "standard", "bulk"}
    assert all(c["on_time"] == 1.0 for c in data["channels"].values())
    assert 0 < data["utilisation"] < 0.6


def test_overload_is_absorbed_by_the_lower_channels_and_the_run_is_deterministic():
    data = run("--rate", "3000", "--duration", "3", "--devices", "1")
    std, rt = data["channels"]["standard"], data["channels"]["realtime"]
    assert std["expired"] + std["overloaded"] > 0          # more than one device can serve
    assert rt["on_time"] > std["on_time"]                    # realtime keeps its deadlines better
    assert data == run("--rate", "3000", "--duration", "3", "--devices", "1")


def test_a_bad_config_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[channels.x]\nmax_batch = 0\nwindow_ms = 1\n")
    result = CliRunner().invoke(app, ["simulate", "--config", str(bad)])
    assert result.exit_code == 2 and "max_batch" in result.output


def test_a_trace_csv_is_replayed_time_compressed(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,374,44\n"
                     "2023-11-16 18:15:50.9951690,9000,109\n"
                     "2023-11-16 18:15:51.2224670,879,55\n")
    data = run("--trace", str(trace), "--compress", "10", "--urgent-share", "0")
    assert data["requests"] == 3
    assert data["channels"]["bulk"]["offered"] == 1        # 9,000 tokens routes to bulk
    assert data["channels"]["standard"]["offered"] == 2
    tagged = run("--trace", str(trace), "--compress", "10", "--urgent-share", "1")
    assert tagged["channels"]["realtime"]["offered"] == 2   # the urgent share applies to a trace too (long: bulk)


def test_status_watch_redraws_until_interrupted(monkeypatch):
    import dynbatchd.cli.dynbatchctl as ctl

    snapshots = iter(range(1, 100))

    def fake_control(ctx, cmd, **args):
        n = next(snapshots)
        return {"daemon": {"version": "x", "pid": 1, "state": "serving", "uptime_s": n, "listen": "ipc://s",
                           "bad_requests": 0},
                "channels": {"standard": {"queue_depth": n, "batches": n, "mean_batch": 1.0, "max_batch": 8,
                                          "fill_rate": 0.1, "p50_ms": 1.0, "p99_ms": 2.0,
                                          "rejected": {"overloaded": 0, "refused": 0}, "deadline_misses": 0,
                                          "window": {"policy": "pattern", "traffic": "burst", "window_ms": 30.0}}},
                "devices": [], "cache": None}

    sleeps = []

    def fake_sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(ctl, "_control", fake_control)
    monkeypatch.setattr(ctl.time, "sleep", fake_sleep)
    monkeypatch.setattr(ctl, "out", ctl.Console(width=160))
    result = CliRunner().invoke(app, ["status", "--watch", "0.5"])
    assert result.exit_code == 0, result.output
    assert sleeps == [0.5, 0.5, 0.5]
    assert "up 3 s" in result.output                      # redrawn with the third snapshot
    assert "pattern:burst 30ms" in result.output and "standard" in result.output


def test_error_text_with_brackets_is_printed_as_is(monkeypatch):
    import dynbatchd.cli.dynbatchctl as ctl
    from dynbatchd.client import DynbatchdError

    def refuse(*args, **kwargs):
        raise DynbatchdError("the result cache is off: set [cache] entries in the config")

    monkeypatch.setattr(ctl, "control_call", refuse)
    result = CliRunner().invoke(app, ["warmup"])
    assert result.exit_code == 1
    assert "[cache] entries" in result.output


def test_a_mixed_pool_simulates_each_device_with_its_own_options(tmp_path):
    """The simulated runner's `devices` table gives one device of a mixed pool its own latency
    model; simulate runs the devices `[devices] use` names, each with its own (as the daemon would)."""
    config = tmp_path / "mixed.toml"
    config.write_text(
        '[devices]\nuse = ["cuda:0", "cuda:1"]\n\n'
        '[models.sim]\nrunner = "simulated"\n'
        'options = { base_ms = 8.0, per_item_ms = 0.5, devices = { "cuda:1" = { per_item_ms = 4.0 } } }\n\n'
        '[channels.standard]\nmax_batch = 16\nwindow_ms = 5.0\n\n[routing]\ndefault = "standard"\n')
    def simulate(*args: str) -> dict:
        result = CliRunner().invoke(app, ["simulate", "--config", str(config), "--json", "--rate", "600",
                                          "--duration", "3", "--tokens", "10", *args])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)
    data = simulate()
    assert data["devices"] == 2
    assert data["device_models"]["cuda:0"]["per_item_ms"] == 0.5
    assert data["device_models"]["cuda:1"]["per_item_ms"] == 4.0
    alike = simulate("--per-item-ms", "0.5")   # the command line wins over every device's own
    assert {m["per_item_ms"] for m in alike["device_models"].values()} == {0.5}
    assert data["utilisation"] > alike["utilisation"]   # the slow device is busier for the same work
    assert simulate("--devices", "1")["device_models"] == {"cuda:0": data["device_models"]["cuda:0"]}
