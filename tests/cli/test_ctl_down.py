"""`dynbatchctl` says at once that the daemon is not running: every control command and `infer`,
when nothing listens at the address (an ipc socket file missing or left behind, a tcp port
refused), print one line and exit 3 (dynbatchctl(1)), without opening a ZeroMQ socket to wait on."""

from __future__ import annotations

import socket

import pytest
import zmq
from typer.testing import CliRunner

from conftest import free_port
from dynbatchd.cli import dynbatchctl as ctl

COMMANDS = [["status"], ["plugins"], ["config"], ["reload"], ["stop"], ["warmup"],
            ["tune", "standard", "--window-ms", "5"], ["tune", "standard", "--rollback"],
            ["tune", "--auto", "standard"], ["infer", "sim", "some text"]]


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch):
    """A ZeroMQ socket is what waits for a timeout: none may be made."""
    def refuse(*a, **k):
        raise AssertionError("a ZeroMQ socket was opened: the CLI would wait for its timeout")
    monkeypatch.setattr(zmq.Context, "socket", refuse)
    monkeypatch.setattr(ctl, "Client", refuse)


def stale_socket(path) -> str:
    """A socket file nobody listens on any more (what a killed daemon leaves)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()
    return f"ipc://{path}"


def addresses(tmp_path) -> dict[str, str]:
    return {"missing": f"ipc://{tmp_path}/nothing.sock", "stale": stale_socket(tmp_path / "stale.sock"),
            "tcp": f"tcp://127.0.0.1:{free_port()}"}


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_every_command_says_the_daemon_is_not_running(tmp_path, args):
    for kind, address in addresses(tmp_path).items():
        result = CliRunner().invoke(ctl.app, ["--control", address, "--endpoint", address, *args])
        assert result.exit_code == ctl.NOT_RUNNING == 3, (kind, result.output)
        assert result.output.count("\n") == 1, result.output
        assert result.output.startswith("error: dynbatchd is not running: "), result.output
