"""dynbatchctl for operators: infer summaries, --json everywhere, status within 80 columns, warmup exit codes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import typer.main
from rich.console import Console
from typer.testing import CliRunner

from dynbatchd import protocol as P
from dynbatchd.cli import dynbatchctl as ctl, plan as planmod
from dynbatchd.client import DynbatchdError, Result

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(ctl.app, ["--control", "ipc:///ctl", "--endpoint", "ipc:///req", *args])


def answer(monkeypatch, replies: dict) -> list:
    calls = []

    def fake(endpoint, cmd, **args):
        calls.append((cmd, args))
        reply = replies[cmd]
        if isinstance(reply, Exception):
            raise reply
        return reply

    monkeypatch.setattr(ctl, "control_call", fake)
    return calls


# --- infer ------------------------------------------------------------------

class FakeClient:
    output: object = None

    def __init__(self, endpoint, timeout=None):
        self.timeout = timeout

    def infer_result(self, model, text, **kwargs):
        return Result(1, self.output, P.Timing(queue_us=1500, compute_us=2500, total_us=4000, batch_size=3,
                                               channel="standard", device="cpu"))

    def close(self):
        pass


@pytest.fixture
def embedding(monkeypatch):
    vector = np.linspace(-1, 1, 384, dtype=np.float32)
    vector /= np.linalg.norm(vector)
    monkeypatch.setattr(FakeClient, "output", vector)
    monkeypatch.setattr(ctl, "Client", FakeClient)
    monkeypatch.setattr(ctl, "check_running", lambda endpoint: None)   # the fake needs no listener
    return vector


def test_infer_summarises_a_long_vector(embedding):
    result = invoke("infer", "minilm", "some text")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 4 and max(map(len, lines)) <= 80, result.output    # not 384
    assert "shape [384] float32" in lines[0] and "L2 norm 1.0000" in lines[0]
    assert f"{embedding[0]:.4f}" in lines[1] and "first 6 of 384" in lines[1] and len(lines[1]) <= 80
    assert "batch size 3" in result.output


def test_infer_json_still_prints_every_value(embedding):
    result = invoke("infer", "minilm", "some text", "--json")
    data = json.loads(result.stdout)
    assert len(data["output"]) == 384 and data["timing"]["batch_size"] == 3


def test_infer_prints_a_short_output_as_is(monkeypatch):
    monkeypatch.setattr(FakeClient, "output", ["echo"])
    monkeypatch.setattr(ctl, "Client", FakeClient)
    monkeypatch.setattr(ctl, "check_running", lambda endpoint: None)   # the fake needs no listener
    result = invoke("infer", "echo", "hi")
    assert result.exit_code == 0 and "['echo']" in result.output


# --- reload, stop, tune -----------------------------------------------------

def test_reload_and_stop_take_json(monkeypatch):
    answer(monkeypatch, {"reload": {"needs_restart": ["models"]}, "stop": {"state": "draining"}})
    assert json.loads(invoke("reload", "--json").stdout) == {"needs_restart": ["models"]}
    assert json.loads(invoke("stop", "--json").stdout) == {"state": "draining"}
    assert "restart needed to change: models" in invoke("reload").output
    assert invoke("stop").output.strip() == "draining"


def test_every_tune_option_has_help():
    tune = typer.main.get_command(ctl.app).commands["tune"]
    bare = [p.name for p in tune.params if getattr(p, "opts", None) and p.opts[0].startswith("--")
            and not getattr(p, "help", None)]
    assert not bare, f"tune options without help: {bare}"


def test_a_refused_tune_prints_the_daemon_s_line(monkeypatch):
    answer(monkeypatch, {"tune": DynbatchdError("refused: channels.standard.window_ms: window 2000 ms exceeds "
                                                "the channel deadline 1000 ms", "control")})
    result = invoke("tune", "standard", "--window-ms", "2000")
    assert result.exit_code == 1 and result.output.count("\n") == 1 and "exceeds the channel deadline" in result.output


# --- status -----------------------------------------------------------------

def status_data(n: int = 1) -> dict:
    channel = {"queue_depth": 1024 * n, "batches": 123456789, "mean_batch": 31.9, "max_batch": 32,
               "fill_rate": 0.997, "p50_ms": 1234.5, "p99_ms": 98765.4,
               "rejected": {"overloaded": 1234567, "refused": 7654321}, "deadline_misses": 2345678,
               "window": {"policy": "pattern", "traffic": "burst", "window_ms": 150.0}}
    device = {"device": "cuda:0", "pid": 4194304, "state": "running", "inflight": 2, "batches": 987654321,
              "items": 31234567890, "busy_fraction": 0.991, "restarts": 12, "simulated": True}
    return {"daemon": {"version": "0.1.0", "pid": 4194304, "state": "serving", "uptime_s": float(n),
                       "listen": "tcp://127.0.0.1:5555", "bad_requests": 0, "health": {"score": 0.91}},
            "channels": {"realtime": channel, "standard": channel, "a_rather_long_bulk_name": channel},
            "devices": [device, {**device, "device": "cuda:1"}], "cache": None}


def rendered(view, width: int) -> list[str]:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))
    console.print(view)
    return console.export_text().splitlines()


def test_status_fits_80_columns_by_dropping_columns():
    lines = rendered(ctl.status_view(status_data(), Console(width=80)), 80)
    assert max(len(line) for line in lines) <= 80
    text = "\n".join(lines)
    assert "…" not in text, text                               # nothing cut mid-value
    for must in ("channel", "queue", "p99 ms", "98765.4", "device", "state"):
        assert must in text
    assert "refused" not in text and "hidden: --wide shows all" in text


def test_status_wide_shows_every_column():
    view = ctl.status_view(status_data(), Console(width=80), wide=True)
    text = "\n".join(rendered(view, 400))
    for header, _, _ in ctl.CHANNEL_COLUMNS + ctl.DEVICE_COLUMNS:
        assert header in text
    assert "hidden" not in text and "7654321" in text


def test_status_command_fits_the_terminal_and_wide_does_not(monkeypatch):
    answer(monkeypatch, {"status": status_data()})
    monkeypatch.setattr(ctl, "out", Console(width=80))
    narrow = invoke("status").output.splitlines()
    assert max(map(len, narrow)) <= 80
    wide = invoke("status", "--wide").output
    assert "refused" in wide and max(map(len, wide.splitlines())) > 80


def test_watch_without_a_terminal_prints_one_plain_frame_per_interval(monkeypatch):
    snapshots = iter(range(1, 10))
    monkeypatch.setattr(ctl, "_control", lambda ctx, cmd, **a: status_data(next(snapshots)))
    sleeps = []

    def fake_sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(ctl.time, "sleep", fake_sleep)
    monkeypatch.setattr(ctl, "out", Console(width=100, force_terminal=False))
    result = runner.invoke(ctl.app, ["status", "--watch", "1"])
    assert result.exit_code == 0, result.output
    assert len(re.findall(r"^--- \d{4}-\d\d-\d\d \d\d:\d\d:\d\d$", result.output, re.MULTILINE)) == 3
    assert [int(m) for m in re.findall(r" up (\d+) s", result.output)] == [1, 2, 3]
    assert "\x1b[" not in result.output                           # no cursor movement or colour


def test_status_once_prints_one_frame_even_with_watch(monkeypatch):
    calls = answer(monkeypatch, {"status": status_data()})
    monkeypatch.setattr(ctl.time, "sleep", lambda s: pytest.fail("--once must not wait"))
    result = invoke("status", "--watch", "1", "--once")
    assert result.exit_code == 0 and result.output.count("channels") == 1 and len(calls) == 1


# --- warmup -----------------------------------------------------------------

def test_warmup_with_the_cache_off_exits_1_with_the_reason(monkeypatch):
    answer(monkeypatch, {"warmup": DynbatchdError("the result cache is off: set [cache] entries in the config "
                                                  "to use warmup", "control")})
    result = invoke("warmup")
    assert result.exit_code == 1 and "the result cache is off" in result.output


@pytest.mark.parametrize("as_json", [False, True])
def test_warmup_that_queued_nothing_exits_1_with_the_reason(monkeypatch, as_json):
    reason = "the daemon has observed no request with a user and a text input yet (0 counted)"
    answer(monkeypatch, {"warmup": {"queued": 0, "already_cached": 0, "backlog": 0, "reason": reason}})
    result = invoke("warmup", *(["--json"] if as_json else []))
    assert result.exit_code == 1
    assert "nothing to warm up" in result.output and "observed no request with a user" in result.output


def test_warmup_that_queued_something_exits_0(monkeypatch):
    answer(monkeypatch, {"warmup": {"queued": 5, "already_cached": 2, "backlog": 5, "channel": "bulk"}})
    result = invoke("warmup")
    assert result.exit_code == 0 and "queued 5 inputs" in result.output


def test_warmup_wait_follows_the_channel_until_every_input_ran(monkeypatch):
    """--wait polls status: the channel's warmup counter, less what it was before, until all 3 ran."""
    statuses = iter([{"warmup": {"items": 10}}, {"warmup": {"items": 11}}, {"warmup": {"items": 13}}])
    calls = []

    def fake(endpoint, cmd, **args):
        calls.append(cmd)
        if cmd == "warmup":
            return {"queued": 3, "already_cached": 0, "backlog": 3, "channel": "bulk"}
        return {"daemon": {"state": "serving"}, "cache": {"warmup_backlog": 1},
                "channels": {"bulk": next(statuses)}}

    monkeypatch.setattr(ctl, "control_call", fake)
    monkeypatch.setattr("dynbatchd.cli.warmup.time.sleep", lambda s: None)
    result = invoke("warmup", "--wait", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["warmed"] == 3
    assert calls == ["status", "warmup", "status", "status"]


# --- the man page tells the truth -------------------------------------------

def test_the_page_does_not_say_every_command_talks_to_the_control_socket():
    page = " ".join((REPO / "man" / "dynbatchctl.1.rst").read_text().split())
    assert "every other command talks to its control socket" not in page
    assert "**plan**, **simulate** and **capacity** talk to no daemon at all" in page


def test_memory_gb_wins_over_nvml_in_the_code_and_the_page(monkeypatch):
    monkeypatch.setattr(planmod, "nvml_memory", lambda index: ("NVIDIA H200", 140 << 30))
    assert planmod.device_memory(None, 8.0, 0)["source"] == "--memory-gb"
    assert planmod.device_memory(None, None, 0)["source"] == "NVML (GPU 0)"
    page = " ".join((REPO / "man" / "dynbatchctl.1.rst").read_text().split())
    assert "**--memory-gb** when given, else from ``[devices] memory_gb``, else from NVML" in page
    assert "NVML (else **--memory-gb**" not in page


def test_status_shows_how_long_plans_take_once_any_ran():
    data = status_data()
    assert "plans" not in "\n".join(rendered(ctl.status_view(data, Console(width=80)), 80))
    data["daemon"]["scheduling"] = {"passes": 40, "seconds": 0.05, "over_lead": 3, "lead_ms": 1.0,
                                    "mean_ms": 1.25, "max_ms": 12.0}
    lines = rendered(ctl.status_view(data, Console(width=80)), 80)
    assert max(map(len, lines)) <= 80
    assert "plans 1.25 ms mean, 3 of 40 over the 1 ms lead" in " ".join(" ".join(lines).split())
