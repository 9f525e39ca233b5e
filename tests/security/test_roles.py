"""Roles of CURVE keys: a client key (keys_dir/clients/) may send requests and read the daemon's
state; only an admin key (keys_dir/admins/) may change it, stop it or read its configuration.
And the rules check-config (and start) enforce around them: no tcp:// control socket without
CURVE, no keys directory others may write, no HTTP door off loopback while CURVE is on.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
from typer.testing import CliRunner

from dynbatchd import config as cfgmod
from dynbatchd.cli.dynbatchd import app as daemon_app
from dynbatchd.client import CurveKeys, DynbatchdError, control_call
from dynbatchd.control.commands import COMMANDS, OPEN_TO_CLIENTS, needs_admin
from dynbatchd.control.server import ControlServer
from dynbatchd.plugins import Plugins
from dynbatchd.transport import CurveServer
from dynbatchd.validation import validate_config

from test_config_plugins import BASE
from test_security_curve import Keys, free_port, start_curve_daemon

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


class Admin(Keys):
    """Keys, plus an admin (bob) in keys_dir/admins/."""

    def __init__(self, root: Path):
        super().__init__(root)
        (self.dir / "admins").mkdir(mode=0o755)
        bob_public, self.bob_secret, _ = cfgmod.write_keypair(self.mine, "bob")
        (self.dir / "admins" / "bob.key").write_bytes(bob_public.read_bytes())
        self.bob = CurveKeys.load(self.bob_secret, self.server_public)


@pytest.fixture
def keys(tmp_path) -> Admin:
    return Admin(tmp_path)


@pytest.fixture(scope="module")
def plugins():
    return Plugins.load()


# --- which command is whose ---------------------------------------------------------------

def test_every_command_is_open_to_clients_or_an_admins():
    assert set(OPEN_TO_CLIENTS) <= set(COMMANDS)
    admin_only = sorted(c for c in COMMANDS if needs_admin(c, {}))
    assert admin_only == ["config", "forget", "reload", "stop", "tune", "warmup"]   # canary: by action, below
    assert not needs_admin("canary", {}) and not needs_admin("canary", {"action": "status"})
    assert needs_admin("canary", {"action": "start"}) and needs_admin("canary", {"action": "stop"})


class FakeDaemon:
    def __init__(self):
        self.state = "serving"
        self.canary = self   # the daemon's CanaryOperations: only its report is read here
        self.operations = self   # and its Operations: status and request_stop

    def status(self):
        return {"daemon": {"state": self.state}, "compliance": {"recent": [{"tenant": "hospital-b"}]}}

    def report(self):
        return {"running": {}, "ended": {}}

    def request_stop(self):
        self.state = "draining"


def test_a_client_key_reads_and_only_an_admin_key_changes_or_stops(keys, plugins):
    control = f"tcp://127.0.0.1:{free_port()}"
    daemon = FakeDaemon()
    daemon.plugins = plugins

    async def main() -> dict:
        ctx = zmq.Context()
        loop = asyncio.get_running_loop()
        curve = CurveServer(ctx, keys.server_secret, keys.dir / "clients", keys.dir / "admins")
        ctl = ControlServer(ctx, control, daemon, curve=curve)
        ctl.io.start(loop)

        async def call(who, cmd, **args):
            try:
                return await loop.run_in_executor(None, lambda: control_call(control, cmd, curve=who, **args))
            except DynbatchdError as exc:
                return f"{exc.code}: {exc}"

        out = {"client " + cmd: await call(keys.alice, cmd) for cmd in ("ping", "status", "plugins", "canary")}
        for cmd, args in (("tune", {"channel": "standard", "max_batch": 2}), ("reload", {}), ("config", {}),
                          ("warmup", {}), ("forget", {"user": "someone"}),
                          ("canary", {"action": "start", "channel": "standard"}),
                          ("canary", {"action": "stop", "channel": "standard"}), ("stop", {})):
            out[f"client {cmd} {args.get('action', '')}".strip()] = await call(keys.alice, cmd, **args)
        out["state after the client's stop"] = daemon.state
        out["refused"] = ctl.refused_not_admin
        out["admin status"] = await call(keys.bob, "status")
        out["admin stop"] = await call(keys.bob, "stop")
        # A key in both directories is an admin's; one moved out of admins/ is a client's again.
        (keys.dir / "admins" / "alice.key").write_bytes(keys.alice_admitted.read_bytes())
        out["alice, made admin"] = await call(keys.alice, "stop")
        (keys.dir / "admins" / "bob.key").rename(keys.dir / "clients" / "bob.key")
        out["bob, made client"] = await call(keys.bob, "stop")
        # An admins directory others may write admits no one (from the next handshake on).
        (keys.dir / "admins").chmod(0o777)
        out["alice, admins 0777"] = await call(keys.alice, "stop")
        ctl.close()
        curve.close()
        ctx.destroy(0)
        return out

    out = asyncio.run(main())
    assert "callable" in out.pop("client plugins")["runners"]
    assert out.pop("client ping") == {"state": "serving"}
    assert out.pop("client status") == {"daemon": {"state": "serving"}}   # no other tenant's refusals
    assert out.pop("admin status")["compliance"] == {"recent": [{"tenant": "hospital-b"}]}
    assert out.pop("client canary") == {"running": {}, "ended": {}}
    for cmd in ("tune", "reload", "config", "warmup", "forget", "canary start", "canary stop", "stop"):
        refusal = out.pop(f"client {cmd}")
        assert refusal.startswith(f"control: {cmd.split()[0]} needs an admin key: CURVE key 'alice' is a client's"), refusal
    assert out.pop("state after the client's stop") == "serving"
    assert out.pop("refused") == 8
    assert out.pop("admin stop") == {"state": "draining"}
    assert out.pop("alice, made admin") == {"state": "draining"}
    assert out.pop("bob, made client").startswith("control: stop needs an admin key: CURVE key 'bob'")
    assert out.pop("alice, admins 0777").startswith("control: stop needs an admin key")
    assert out == {}


def test_an_ipc_control_socket_needs_no_key_its_file_guards_it(tmp_path):
    daemon = FakeDaemon()
    endpoint = f"ipc://{tmp_path}/ctl.sock"

    async def main():
        ctx = zmq.Context()
        ctl = ControlServer(ctx, endpoint, daemon)
        ctl.io.start(asyncio.get_running_loop())
        reply = await asyncio.get_running_loop().run_in_executor(None, lambda: control_call(endpoint, "stop"))
        ctl.close()
        ctx.destroy(0)
        return reply

    assert asyncio.run(main()) == {"state": "draining"}
    assert not (tmp_path / "ctl.sock").exists(), "the socket file outlived its socket"


# --- what check-config (and start) refuse -------------------------------------------------

def curve_config(tmp_path: Path, keys: Keys, extra: str = "") -> cfgmod.Config:
    path = tmp_path / "c.toml"
    path.write_text(f'[daemon]\nlisten = "tcp://127.0.0.1:5555"\ncontrol = "ipc://{tmp_path}/c"\ncurve = true\n'
                    f'keys_dir = "{keys.dir}"\n{extra}' + BASE)
    return cfgmod.load(path)


@pytest.mark.parametrize("where", [".", "clients", "admins"])
@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777])
def test_a_keys_directory_others_may_write_is_refused_naming_it(tmp_path, keys, plugins, where, mode):
    cfg = curve_config(tmp_path, keys)
    validate_config(cfg, plugins)
    directory = (keys.dir / where).resolve()
    directory.chmod(mode)
    with pytest.raises(cfgmod.ConfigError) as caught:
        validate_config(cfg, plugins)
    assert caught.value.key == "daemon.keys_dir"
    assert f"{directory} is mode {mode:04o}" in caught.value.rule and "group or others may write" in caught.value.rule
    # and `dynbatchd start` refuses it the same way, before binding anything
    result = CliRunner().invoke(daemon_app, ["start", "--config", cfg.source])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "group or others may write" in result.output


def test_admins_is_optional_but_must_hold_keys(tmp_path, keys, plugins):
    cfg = curve_config(tmp_path, keys)
    (keys.dir / "admins" / "bob.key").unlink()
    (keys.dir / "admins").rmdir()
    validate_config(cfg, plugins)   # no admin over tcp://: the ipc:// control socket stays the way in
    (keys.dir / "admins").write_text("not a directory\n")
    with pytest.raises(cfgmod.ConfigError, match="admins is not a directory"):
        validate_config(cfg, plugins)
    (keys.dir / "admins").unlink()
    (keys.dir / "admins").mkdir(mode=0o755)
    (keys.dir / "admins" / "junk.key").write_text("junk\n")
    with pytest.raises(cfgmod.ConfigError) as caught:
        validate_config(cfg, plugins)
    assert caught.value.key == "daemon.keys_dir" and caught.value.rule.startswith("an admin key: ")
    assert "junk.key" in caught.value.rule


def test_the_http_door_off_loopback_with_curve_on_is_refused_at_start(tmp_path, keys):
    cfg = curve_config(tmp_path, keys, extra="")
    path = Path(cfg.source)
    path.write_text(path.read_text() + '[http]\nlisten = "0.0.0.0:8080"\n')
    for args in (["check-config", str(path)], ["start", "--config", str(path)]):
        result = CliRunner().invoke(daemon_app, args)
        assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
        assert "http.keys: daemon.curve is on and the HTTP door has no API keys" in result.output


# --- end to end ---------------------------------------------------------------------------

def test_the_daemon_lets_clients_read_and_admins_change_and_stop_it(tmp_path, keys):
    proc, endpoint, control, log = start_curve_daemon(tmp_path, keys)
    ctl = [str(Path(sys.executable).parent / "dynbatchctl"), "--control", control, "--endpoint", endpoint,
           "--server-key", str(keys.server_public)]

    def dynbatchctl(secret: Path, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*ctl, "--curve-key", str(secret), *args], capture_output=True, text=True, timeout=60)

    try:
        status = dynbatchctl(keys.alice_secret, "status", "--json")
        assert status.returncode == 0 and json.loads(status.stdout)["daemon"]["state"] == "serving", status.stderr
        audit = dynbatchctl(keys.alice_secret, "status", "--compliance")   # withheld, and said so
        assert audit.returncode == 1 and audit.stderr.count("\n") == 1, audit.stderr
        assert "error: status --compliance needs an admin key" in audit.stderr
        assert dynbatchctl(keys.bob_secret, "status", "--compliance", "--json").returncode == 0
        for args in (("tune", "standard", "--max-batch", "4"), ("config",), ("stop",)):
            refused = dynbatchctl(keys.alice_secret, *args)
            assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
            assert f"error: {args[0]} needs an admin key: CURVE key 'alice' is a client's" in refused.stderr
        assert proc.poll() is None
        tuned = dynbatchctl(keys.bob_secret, "tune", "standard", "--max-batch", "4", "--json")
        assert tuned.returncode == 0 and json.loads(tuned.stdout)["max_batch"] == 4, tuned.stderr
        assert control_call(control, "config", curve=keys.bob)["channels"]["standard"]["max_batch"] == 4
        stopped = dynbatchctl(keys.bob_secret, "stop")
        assert stopped.returncode == 0, stopped.stderr
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    logged = log.read_text()
    assert "1 client keys admitted" in logged and "1 admin keys from" in logged
    assert "control: refused config to CURVE key 'alice', a client's" in logged   # (the rest within 10 s: counted)
