"""Files the daemon reads at start and reload, broken as a fuzzing pass broke them: TOML nested
thousands deep (a RecursionError in the parser) is one ConfigError naming the file, in
check-config and as the tuning drop-in; a ``daemon.state_dir`` that is a file stops ``start`` with
one line naming the key; a top-users file whose counts would overflow on the next save is refused
as it is read. The sketch's byte bounds are ``[top_users]`` keys, and a reload that changes the
table says it needs a restart instead of keeping the old sketch silently."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from typer.testing import CliRunner

from dynbatchd import config as cfgmod
from dynbatchd.cache_operations import CacheOperations
from dynbatchd.cli.dynbatchd import app as daemon_app
from dynbatchd.config.paths import StateDirError
from dynbatchd.overrides import Overrides
from dynbatchd.topusers import TopUsers

from test_config_plugins import BASE

REPO = Path(__file__).resolve().parents[2]
DEEP = "a = " + "[" * 5000 + "]" * 5000 + "\n"


def test_toml_nested_too_deeply_is_a_config_error_naming_the_file(tmp_path):
    path = tmp_path / "deep.toml"
    path.write_text(DEEP)
    with pytest.raises(cfgmod.ConfigError) as info:
        cfgmod.read_toml(path)
    assert info.value.file == str(path) and "nested too deeply" in info.value.rule


def test_check_config_says_so_in_one_line(tmp_path):
    path = tmp_path / "deep.toml"
    path.write_text(DEEP)
    result = CliRunner().invoke(daemon_app, ["check-config", str(path)])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output[:2000]
    assert lines[0] == f"error: {path}: not valid TOML: arrays or inline tables nested too deeply"


def test_a_deep_tuning_drop_in_is_refused_as_every_corrupt_one_is(tmp_path):
    path = tmp_path / "overrides.toml"
    path.write_text(DEEP)
    with pytest.raises(cfgmod.ConfigError, match="nested too deeply"):   # init_tuning logs it and ignores it
        Overrides.load(path)


def test_state_dir_that_is_a_file_is_a_one_line_error_naming_the_key(tmp_path):
    state = tmp_path / "state"
    state.write_text("")
    settings = cfgmod.parse({"daemon": {"state_dir": str(state)}, **_base()}).daemon
    with pytest.raises(StateDirError) as info:
        cfgmod.state_path(settings, "overrides.toml")
    assert isinstance(info.value, OSError)   # callers that carry on without it still catch it
    assert str(info.value) == f"daemon.state_dir: {state}: not a directory"


def test_start_with_state_dir_a_file_exits_1_with_one_error_line(tmp_path):
    state = tmp_path / "state"
    state.write_text("")
    config = tmp_path / "c.toml"
    config.write_text(textwrap.dedent(f"""
        [daemon]
        state_dir = "{state}"
        control = "ipc://{tmp_path}/ctl.sock"
        listen = "ipc://{tmp_path}/req.sock"
    """) + textwrap.dedent(BASE))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "dynbatchd", "start", "--config", str(config)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"error: {config}: daemon.state_dir: {state}: not a directory" in proc.stderr.splitlines()


def test_a_top_users_file_with_counts_near_2_64_is_refused_at_load(tmp_path, caplog):
    path = tmp_path / "top-users.msgpack"
    sketch = TopUsers(users=10)
    sketch.observe(None, "bob", "m", "hello")
    sketch.save(path)
    saved = msgspec.msgpack.decode(path.read_bytes())
    saved["observed"] = 2**64 - 1
    path.write_bytes(msgspec.msgpack.encode(saved))
    with caplog.at_level("WARNING"):
        loaded = TopUsers.load(path, users=10)
    assert len(loaded) == 0 and loaded.observed == 0 and "count outside" in caplog.text
    loaded.observe(None, "bob", "m", "hello")
    loaded.save(path)   # what failed (OverflowError) on every save before


def test_a_top_users_count_near_2_64_is_refused_too(tmp_path):
    path = tmp_path / "top-users.msgpack"
    sketch = TopUsers(users=10)
    sketch.observe(None, "bob", "m", "hello")
    sketch.save(path)
    saved = msgspec.msgpack.decode(path.read_bytes())
    saved["users"][0][2] = 2**64 - 1   # bob's count
    path.write_bytes(msgspec.msgpack.encode(saved))
    assert len(TopUsers.load(path, users=10)) == 0


def _base() -> dict:
    import tomllib
    return tomllib.loads(textwrap.dedent(BASE))


@pytest.mark.parametrize("table, key", [("[http]\nlisten = '127.0.0.1:{port}'\n", "http.listen"),
                                        ("[daemon]\nmetrics_listen = '127.0.0.1:{port}'\n", "daemon.metrics_listen")])
def test_a_listen_port_past_65535_or_0_names_the_key(tmp_path, table, key):
    from test_config_plugins import load_error

    for port in (70000, 0):
        err = load_error(tmp_path, BASE + table.format(port=port))
        assert err.key == key and "the port must be 1 to 65535" in err.rule, str(err)
    path = tmp_path / "ok.toml"
    path.write_text(BASE + table.format(port=65535))
    cfgmod.load(path)


def test_the_top_users_byte_bounds_come_from_the_config(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(BASE + textwrap.dedent(f"""
        [daemon]
        state_dir = "{tmp_path}"
        [top_users]
        max_text_bytes = 100
        text_budget_bytes = 4096
    """))
    config = cfgmod.load(path)
    daemon = SimpleNamespace(cache=object(), config=config)   # the cache on: texts are kept
    sketch = CacheOperations(daemon).load_top_users(config)
    assert (sketch.max_text_bytes, sketch.text_budget) == (100, 4096)
    sketch.observe(None, "bob", "m", "x" * 101)
    sketch.observe(None, "bob", "m", "y" * 100)
    [(_, _, count, inputs)] = sketch.top(1)
    assert count == 2 and inputs == [("m", "y" * 100)]   # the longer text counted, not kept


@pytest.mark.parametrize("key, value", [("max_text_bytes", 0), ("max_text_bytes", 2 << 20),
                                        ("text_budget_bytes", 10)])
def test_a_top_users_byte_bound_out_of_range_names_the_key(tmp_path, key, value):
    path = tmp_path / "c.toml"
    path.write_text(BASE + f"[top_users]\n{key} = {value}\n")
    with pytest.raises(cfgmod.ConfigError, match=f"top_users.{key}"):
        cfgmod.load(path)
