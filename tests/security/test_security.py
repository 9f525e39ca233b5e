"""Security of the daemon's sockets: where the control socket is by default and who may use it,
which control addresses are refused, and CURVE keys (keygen, key files, config checks).

The CURVE handshakes themselves, in process and end to end, are in tests/security/test_security_curve.py.
"""

from __future__ import annotations

import os
import socket
import stat
import textwrap
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth
from typer.testing import CliRunner

from dynbatchd import config as cfgmod
from dynbatchd.cli import dynbatchctl as ctl
from dynbatchd.control.server import ControlServer
from dynbatchd.plugins import Plugins
from dynbatchd.validation import validate_config

BASE = textwrap.dedent("""
    [models.m]
    runner = "noop"
    [channels.standard]
    max_batch = 4
    window_ms = 1
""")


def load(tmp_path: Path, text: str) -> cfgmod.Config:
    path = tmp_path / "dynbatchd.toml"
    path.write_text(text)
    return cfgmod.load(path)


@pytest.fixture(scope="module")
def plugins():
    return Plugins.load()


@pytest.fixture
def no_system_dir(monkeypatch, tmp_path):
    """No running system service (no /run/dynbatchd) and no systemd runtime directory."""
    monkeypatch.setattr(cfgmod.paths, "SYSTEM_RUNTIME_DIR", str(tmp_path / "no-such-run-dir"))
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)


# --- the default control socket ----------------------------------------------------

def test_under_systemd_the_default_is_in_the_runtime_directory(monkeypatch):
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/dynbatchd")
    assert cfgmod.default_control() == "ipc:///run/dynbatchd/control.sock"
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/dynbatchd:/run/other")   # several: the first
    assert cfgmod.default_control() == "ipc:///run/dynbatchd/control.sock"
    assert cfgmod.DaemonSettings().control == "ipc:///run/dynbatchd/control.sock"


def test_a_running_system_service_is_found_without_runtime_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    system = tmp_path / "run-dynbatchd"
    system.mkdir()
    monkeypatch.setattr(cfgmod.paths, "SYSTEM_RUNTIME_DIR", str(system))
    assert cfgmod.default_control() == f"ipc://{system}/control.sock"


def test_from_a_checkout_the_default_is_a_private_per_user_directory(monkeypatch, tmp_path, no_system_dir):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert cfgmod.default_control() == f"ipc://{tmp_path}/dynbatchd/control.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert cfgmod.default_control() == f"ipc:///tmp/dynbatchd-{os.getuid()}/control.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))   # not a directory: not used
    assert cfgmod.default_control() == f"ipc:///tmp/dynbatchd-{os.getuid()}/control.sock"


def test_dynbatchctl_and_the_daemon_agree_on_the_default(monkeypatch, tmp_path, no_system_dir):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("DYNBATCHD_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)   # no ./etc/dynbatchd.toml
    monkeypatch.setattr(cfgmod.paths, "DEFAULT_CONFIG_PATHS", ("etc/dynbatchd.toml",))
    daemon_side = load(tmp_path, BASE).daemon.control
    assert ctl.Target(None, None, None).control == daemon_side == f"ipc://{tmp_path}/dynbatchd/control.sock"
    seen = []
    monkeypatch.setattr(ctl, "control_call", lambda endpoint, cmd, **a: seen.append(endpoint) or {"state": "x"})
    result = CliRunner().invoke(ctl.app, ["stop"])
    assert result.exit_code == 0, result.output
    assert seen == [daemon_side]


def test_the_shipped_config_leaves_the_control_socket_to_the_default(monkeypatch, tmp_path, no_system_dir):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    shipped = cfgmod.load(Path(__file__).resolve().parents[2] / "etc" / "dynbatchd.toml")
    assert shipped.daemon.control == cfgmod.default_control()
    assert shipped.daemon.curve is False and shipped.daemon.keys_dir == "/etc/dynbatchd/keys"


def test_the_private_directory_is_made_0700_and_tightened(tmp_path):
    made = cfgmod.ensure_private_dir(tmp_path / "d")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    made.chmod(0o755)
    cfgmod.ensure_private_dir(made)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_a_private_directory_of_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 4242, 4242)
    with pytest.raises(cfgmod.UnsafeDirectory, match="belongs to uid 4242"):
        cfgmod.ensure_private_dir(theirs)


def test_the_control_socket_file_is_0660_and_the_daemon_s_group(monkeypatch, tmp_path, no_system_dir):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    endpoint = cfgmod.default_control()
    old = os.umask(0o000)   # a careless umask must not open the socket to everyone
    ctx = zmq.Context()
    try:
        server = ControlServer(ctx, endpoint, None)
        path = Path(endpoint[len("ipc://"):])
        info = path.stat()
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o660 and info.st_gid == os.getegid()
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and path.parent.stat().st_uid == os.getuid()
        # A second daemon must not steal a live socket (libzmq would unlink it): address in use.
        with pytest.raises(zmq.ZMQError) as caught:
            ControlServer(ctx, endpoint, None)
        assert caught.value.errno == zmq.EADDRINUSE
        server.io.sock.close(0)
        from dynbatchd.transport import _ipc_in_use

        for _ in range(200):   # libzmq closes the listener in its own thread
            if not _ipc_in_use(str(path)):
                break
            time.sleep(0.01)
        # A stale file (no one listening) is no obstacle.
        ControlServer(ctx, endpoint, None).io.sock.close(0)
    finally:
        os.umask(old)
        ctx.term()


def test_a_stale_socket_file_left_by_a_dead_daemon_is_replaced(tmp_path):
    path = tmp_path / "ctl.sock"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(path))   # a socket file no one accepts on
    ctx = zmq.Context()
    try:
        ControlServer(ctx, f"ipc://{path}", None).io.sock.close(0)
    finally:
        ctx.term()


# --- which control addresses are refused --------------------------------------------

@pytest.mark.parametrize("control", ["tcp://0.0.0.0:5556", "tcp://*:5556", "tcp://10.1.2.3:5556"])
def test_a_control_socket_off_loopback_needs_curve(tmp_path, control):
    with pytest.raises(cfgmod.ConfigError) as caught:
        load(tmp_path, f'[daemon]\ncontrol = "{control}"\n' + BASE)
    assert caught.value.key == "daemon.control" and "CURVE is off" in caught.value.rule
    cfg = load(tmp_path, f'[daemon]\ncontrol = "{control}"\ncurve = true\n' + BASE)
    assert cfg.daemon.control == control and cfgmod.curve_endpoints(cfg.daemon) == [cfg.daemon.listen, control]


def test_an_abstract_control_socket_is_refused_even_with_curve(tmp_path):
    for extra in ("", "curve = true\n"):
        with pytest.raises(cfgmod.ConfigError) as caught:
            load(tmp_path, f'[daemon]\ncontrol = "ipc://@dynbatchd"\n{extra}' + BASE)
        assert caught.value.key == "daemon.control" and "abstract" in caught.value.rule


def test_curve_secures_tcp_addresses_only(tmp_path):
    cfg = load(tmp_path, f'[daemon]\nlisten = "ipc://{tmp_path}/r"\ncontrol = "tcp://127.0.0.1:1"\n'
                         'curve = true\n' + BASE)
    assert cfgmod.curve_endpoints(cfg.daemon) == ["tcp://127.0.0.1:1"]
    off = load(tmp_path, BASE)
    assert cfgmod.curve_endpoints(off.daemon) == []


# --- keys -----------------------------------------------------------------------------

def test_keygen_writes_a_pair_pyzmq_reads_with_the_secret_0600(tmp_path):
    old = os.umask(0o000)
    try:
        result = CliRunner().invoke(ctl.app, ["keygen", "server", "--dir", str(tmp_path / "keys"), "--json"])
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    import json

    made = json.loads(result.stdout)
    public_file, secret_file = Path(made["public_file"]), Path(made["secret_file"])
    assert (public_file.name, secret_file.name) == ("server.key", "server.key_secret")
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(public_file.stat().st_mode) == 0o644
    public, secret = zmq.auth.load_certificate(secret_file)
    assert public.decode() == made["public_key"] and zmq.auth.load_certificate(public_file) == (public, None)
    assert zmq.curve_public(secret) == public   # a real pair
    assert "secret-key" not in public_file.read_text()
    # Never overwritten unasked; --force makes a new pair.
    again = CliRunner().invoke(ctl.app, ["keygen", "server", "--dir", str(tmp_path / "keys")])
    assert again.exit_code == 1 and "exists" in again.output and zmq.auth.load_certificate(secret_file)[1] == secret
    forced = CliRunner().invoke(ctl.app, ["keygen", "server", "--dir", str(tmp_path / "keys"), "--force"])
    assert forced.exit_code == 0 and zmq.auth.load_certificate(secret_file)[1] != secret
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600


def test_keygen_under_a_umask_of_002_makes_directories_its_group_cannot_write(tmp_path):
    """mkdir takes the umask's mode: a new clients/ came out 0775, and the daemon refused it at start."""
    old = os.umask(0o002)
    try:
        cfgmod.write_keypair(tmp_path / "keys" / "clients", "alice")
    finally:
        os.umask(old)
    for directory in (tmp_path / "keys", tmp_path / "keys" / "clients"):
        assert not cfgmod.writable_by_others(directory), oct(os.stat(directory).st_mode)


def test_keygen_defaults_to_the_users_config_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    result = CliRunner().invoke(ctl.app, ["keygen"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "dynbatchd" / "client.key_secret").is_file() and (tmp_path / "dynbatchd" / "client.key").is_file()


def test_keygen_refuses_a_name_that_is_a_path(tmp_path):
    result = CliRunner().invoke(ctl.app, ["keygen", "../x", "--dir", str(tmp_path)])
    assert result.exit_code == 2 and "not a key name" in result.output


def test_keygen_into_a_dir_that_is_a_file_names_the_path_and_forget_of_no_user_is_usage(tmp_path):
    """Found by fuzzing: `keygen z --dir FILE` said only "File exists"; `forget ""` exited 1."""
    (tmp_path / "afile").write_text("")
    result = CliRunner().invoke(ctl.app, ["keygen", "z", "--dir", str(tmp_path / "afile")])
    assert result.exit_code == 1 and str(tmp_path / "afile") in result.output, result.output
    result = CliRunner().invoke(ctl.app, ["forget", ""])
    assert result.exit_code == 2 and "needs a user id" in result.output, result.output


def test_key_files_that_will_not_do_are_one_line_naming_the_file(tmp_path):
    public_file, secret_file, _ = cfgmod.write_keypair(tmp_path, "c")
    with pytest.raises(cfgmod.KeyFileError, match="has no secret-key"):
        cfgmod.read_key_file(public_file, secret=True)
    secret_file.chmod(0o644)
    with pytest.raises(cfgmod.KeyFileError, match="mode is 0644"):
        cfgmod.read_key_file(secret_file, secret=True)
    with pytest.raises(cfgmod.KeyFileError, match="cannot read"):
        cfgmod.read_key_file(tmp_path / "missing.key")
    (tmp_path / "junk.key").write_text("hello\n")
    with pytest.raises(cfgmod.KeyFileError, match="not a key file"):
        cfgmod.read_key_file(tmp_path / "junk.key")
    (tmp_path / "short.key").write_text('curve\n    public-key = "abc"\n')
    with pytest.raises(cfgmod.KeyFileError, match="not a Z85 CURVE key"):
        cfgmod.read_key_file(tmp_path / "short.key")


def test_a_key_file_that_is_no_file_or_half_a_line_is_a_key_file_error_at_once(tmp_path):
    """Found by fuzzing: "public-key" without "=" made pyzmq raise IndexError (a traceback from the
    CLI, and the daemon's ZAP handler ended, refusing every client); a FIFO's open blocked for ever."""
    import os
    import threading

    (tmp_path / "half.key").write_text("public-key\n")
    with pytest.raises(cfgmod.KeyFileError, match="not a key file"):
        cfgmod.read_key_file(tmp_path / "half.key")
    (tmp_path / "big.key").write_bytes(b"#" * (cfgmod.keys.KEY_FILE_BYTES + 1))
    with pytest.raises(cfgmod.KeyFileError, match="larger than"):
        cfgmod.read_key_file(tmp_path / "big.key")
    os.mkfifo(tmp_path / "fifo.key")
    raised: list[Exception] = []
    reader = threading.Thread(target=lambda: raised.append(pytest.raises(
        cfgmod.KeyFileError, cfgmod.read_key_file, tmp_path / "fifo.key").value), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():   # (unblock the open, so the thread ends, then fail)
        os.close(os.open(tmp_path / "fifo.key", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading a FIFO key file blocked")
    assert raised and "not a file" in str(raised[0])


def test_curve_on_needs_the_server_key_pair_and_a_clients_directory(tmp_path, plugins):
    keys = tmp_path / "keys"
    text = f'[daemon]\nlisten = "tcp://127.0.0.1:5555"\ncurve = true\nkeys_dir = "{keys}"\n' + BASE
    cfg = load(tmp_path, text)
    with pytest.raises(cfgmod.ConfigError) as caught:
        validate_config(cfg, plugins)
    assert caught.value.key == "daemon.keys_dir" and "server.key_secret" in caught.value.rule
    assert "dynbatchctl keygen server" in caught.value.rule
    cfgmod.write_keypair(keys, "server")
    with pytest.raises(cfgmod.ConfigError) as caught:
        validate_config(cfg, plugins)
    assert "clients is not a directory" in caught.value.rule
    (keys / "clients").mkdir()
    validate_config(cfg, plugins)   # no client admitted yet is allowed
    (keys / "clients" / "bad.key").write_text("nothing\n")
    with pytest.raises(cfgmod.ConfigError) as caught:
        validate_config(cfg, plugins)
    assert "bad.key" in caught.value.rule


def test_curve_off_or_ipc_only_reads_no_key(tmp_path, plugins):
    validate_config(load(tmp_path, f'[daemon]\nkeys_dir = "{tmp_path}/nowhere"\n' + BASE), plugins)
    validate_config(load(tmp_path, f'[daemon]\nlisten = "ipc://{tmp_path}/r"\ncontrol = "ipc://{tmp_path}/c"\n'
                                   f'curve = true\nkeys_dir = "{tmp_path}/nowhere"\n' + BASE), plugins)


def test_dynbatchctl_with_curve_on_and_no_client_key_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "empty"))
    monkeypatch.delenv("DYNBATCHD_CURVE_KEY", raising=False)
    monkeypatch.delenv("DYNBATCHD_SERVER_KEY", raising=False)
    config = tmp_path / "d.toml"
    config.write_text(f'[daemon]\ncontrol = "tcp://127.0.0.1:1"\ncurve = true\nkeys_dir = "{tmp_path}"\n' + BASE)
    monkeypatch.setattr(ctl, "control_call", lambda *a, **k: pytest.fail("called without keys"))
    result = CliRunner().invoke(ctl.app, ["--config", str(config), "status"])
    assert result.exit_code == 2 and result.output.startswith("error: CURVE keys for tcp://127.0.0.1:1: ")
    assert "--curve-key" in result.output and result.output.count("\n") == 1


def test_dynbatchctl_takes_its_keys_from_options_or_the_environment(monkeypatch, tmp_path):
    _, client_secret, _ = cfgmod.write_keypair(tmp_path, "client")
    server_public, _, _ = cfgmod.write_keypair(tmp_path, "server")
    seen = []
    monkeypatch.setattr(ctl, "control_call", lambda endpoint, cmd, **a: seen.append(a.get("curve")) or {"state": "x"})
    flags = ["--control", "tcp://127.0.0.1:1", "--endpoint", "tcp://127.0.0.1:2"]
    result = CliRunner().invoke(ctl.app, [*flags, "--curve-key", str(client_secret), "--server-key",
                                          str(server_public), "stop"])
    assert result.exit_code == 0, result.output
    monkeypatch.setenv("DYNBATCHD_CURVE_KEY", str(client_secret))
    monkeypatch.setenv("DYNBATCHD_SERVER_KEY", str(server_public))
    result = CliRunner().invoke(ctl.app, [*flags, "stop"])
    assert result.exit_code == 0, result.output
    client_pub, client_sec = zmq.auth.load_certificate(client_secret)
    for keys in seen:
        assert (keys.public, keys.secret, keys.server) == (client_pub, client_sec,
                                                           zmq.auth.load_certificate(server_public)[0])
    # An ipc:// control socket takes no keys: none are passed on.
    seen.clear()
    result = CliRunner().invoke(ctl.app, ["--control", f"ipc://{tmp_path}/c", "stop"])
    assert result.exit_code == 0 and seen == [None]
