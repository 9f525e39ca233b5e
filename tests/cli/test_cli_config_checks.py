"""Config checks: runner options, bounded numbers, a private control socket, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dynbatchd import config as cfgmod
from dynbatchd.cli import dynbatchctl as ctl
from dynbatchd.cli.dynbatchd import app as daemon_app
from dynbatchd.config import ConfigError
from dynbatchd.control import commands
from dynbatchd.plugins import Plugins
from dynbatchd.validation import validate_config

from test_config_plugins import BASE   # one minimal config for all the config tests

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plugins():
    return Plugins.load()


def write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def check(tmp_path: Path, text: str, plugins) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        validate_config(cfgmod.load(write(tmp_path, text)), plugins)
    return info.value


# --- runner options ---------------------------------------------------------

def test_a_callable_model_without_target_is_refused_naming_the_key(tmp_path, plugins):
    err = check(tmp_path, BASE.replace('runner = "noop"', 'runner = "callable"'), plugins)
    assert err.key == "models.m.options.target"
    assert "required" in err.rule and "module:function" in err.rule


def test_start_exits_2_on_a_callable_without_target(tmp_path):
    path = write(tmp_path, BASE.replace('runner = "noop"', 'runner = "callable"'))
    for args in (["check-config", str(path)], ["start", "--config", str(path)]):
        result = CliRunner().invoke(daemon_app, args)
        assert result.exit_code == 2, (args, result.output)
        assert "models.m.options.target" in result.output


@pytest.mark.parametrize("runner, options, key, rule", [
    ("simulated", "{ base_mss = 2.0 }", "models.m.options.base_mss", "did you mean `base_ms`"),
    ("simulated", "{ base_ms = inf }", "models.m.options.base_ms", "got `inf`"),
    ("simulated", "{ memory_items = 1.5 }", "models.m.options.memory_items", "integer"),
    ("simulated", "{ per_item_ms = true }", "models.m.options.per_item_ms", "number"),
    ("noop", "{ speed = 1 }", "models.m.options.speed", "unknown option of the noop runner"),
    ("sentence-embedding", "{ max_token = 128 }", "models.m.options.max_token", "did you mean `max_tokens`"),
    ("sentence-embedding", '{ normalize = "yes" }', "models.m.options.normalize", "true or false"),
    ("callable", '{ target = "no_colon" }', "models.m.options.target", "module:function"),
    ("callable", '{ target = "helpers:echo_or_fail", extra = 1 }', "models.m.options.extra", "unknown option"),
])
def test_runner_options_are_checked_against_what_the_runner_declares(tmp_path, plugins, runner, options, key, rule):
    text = BASE.replace('runner = "noop"', f'runner = "{runner}"\noptions = {options}')
    err = check(tmp_path, text, plugins)
    assert err.key == key and rule in err.rule, err


def test_declared_runner_options_pass(tmp_path, plugins):
    for runner, options in (("simulated", "{ base_ms = 2, per_item_ms = 0.1, per_token_ms = 0.0, memory_items = 8, "
                                          "memory_tokens = 0, oom_ms = 1.5 }"),
                            ("sentence-embedding", "{ max_tokens = 128, normalize = false }"),
                            ("callable", '{ target = "helpers:echo_or_fail", path = "/m", max_tokens = 512 }')):
        validate_config(cfgmod.load(write(tmp_path, BASE.replace('runner = "noop"',
                                                                    f'runner = "{runner}"\noptions = {options}'))),
                        plugins)


def test_runner_options_are_checked_without_importing_torch(tmp_path):
    path = write(tmp_path, BASE.replace('runner = "noop"', 'runner = "sentence-embedding"\n'
                                                              'options = { max_tokens = 0 }'))
    code = textwrap.dedent(f"""
        import sys
        from dynbatchd import config
        from dynbatchd.plugins import Plugins
        from dynbatchd.validation import validate_config
        try:
            validate_config(config.load({str(path)!r}), Plugins.load())
        except config.ConfigError as exc:
            print(exc.key)
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["models.m.options.max_tokens", "False"]


# --- bounded numbers --------------------------------------------------------

@pytest.mark.parametrize("value, shown", [("inf", "inf"), ("nan", ""), ("1e308", "1e+308"), ("-inf", "")])
def test_absurd_deadlines_in_a_file_are_refused_naming_the_key(tmp_path, plugins, value, shown):
    err = check(tmp_path, BASE + f"deadline_ms = {value}\n", plugins)
    assert err.key == "channels.standard.deadline_ms", err
    assert shown in err.rule


@pytest.mark.parametrize("old, new, key", [
    ("window_ms = 10", "window_ms = 1e308", "channels.standard.window_ms"),
    ("max_batch = 8", "max_batch = 99999999", "channels.standard.max_batch"),
    ("max_batch = 8", "max_batch = 8\nqueue_limit = 9223372036854775807", "channels.standard.queue_limit"),
    ("[models.m]", "[devices]\nbatch_timeout_s = inf\n[models.m]", "devices.batch_timeout_s"),
    ("[models.m]", "[daemon]\ndrain_timeout_s = 1e300\n[models.m]", "daemon.drain_timeout_s"),
    ("[models.m]", "[compliance]\nbanking_max_window_ms = inf\n[models.m]", "compliance.banking_max_window_ms"),
])
def test_other_settings_are_bounded_too(tmp_path, plugins, old, new, key):
    assert check(tmp_path, BASE.replace(old, new), plugins).key == key


def test_a_range_error_says_what_was_given():
    with pytest.raises(ConfigError) as info:
        cfgmod.parse({"models": {"m": {"runner": "noop"}}, "channels": {"s": {"max_batch": 0, "window_ms": 1}}})
    assert str(info.value) == "<memory>: channels.s.max_batch: expected `int` >= 1, got `0`"


class FakeDaemon:
    """Just what the tune and reload commands touch."""

    def __init__(self, config, reload_from: Path | None = None):
        self.config, self.reload_from, self.applied = config, reload_from, []
        self.operations = self   # the commands call daemon.operations.tune / .reload

    def apply_config(self, new):
        self.applied.append(new)
        return []

    def reload(self):
        return self.apply_config(cfgmod.load(self.reload_from))


@pytest.mark.parametrize("changes, key", [
    ({"deadline_ms": float("inf")}, "channels.standard.deadline_ms"),
    ({"deadline_ms": float("nan")}, "channels.standard.deadline_ms"),
    ({"window_ms": 1e308, "deadline_ms": 1e308}, "channels.standard.window_ms"),
    ({"max_batch": 99999999999999999999}, "channels.standard.max_batch"),
])
def test_the_tune_command_refuses_absurd_values_naming_the_key(changes, key):
    daemon = FakeDaemon(cfgmod.load(REPO / "etc" / "dynbatchd.toml"))
    with pytest.raises(commands.CommandError) as info:
        commands.tune(daemon, "standard", **changes)
    assert key in str(info.value) and not daemon.applied


def test_refused_tune_and_reload_keep_the_value_given(tmp_path):
    daemon = FakeDaemon(cfgmod.load(REPO / "etc" / "dynbatchd.toml"),
                        reload_from=write(tmp_path, BASE.replace("max_batch = 8", "max_batch = 0")))
    with pytest.raises(commands.CommandError) as tuned:
        commands.tune(daemon, "standard", max_batch=0)
    assert str(tuned.value) == "refused: channels.standard.max_batch: expected `int` >= 1, got `0`"
    with pytest.raises(commands.CommandError) as reloaded:
        commands.reload(daemon)
    assert "channels.standard.max_batch: expected `int` >= 1, got `0`" in str(reloaded.value)


def test_policy_options_that_overflow_are_a_config_error(tmp_path, plugins, monkeypatch):
    import dynbatchd.validation as validation

    def overflowing(*args, **kwargs):
        return int(float("inf"))   # what a policy does with `options = { x_ms = 1e308 }` times 1e6

    monkeypatch.setattr(validation, "build_channels", overflowing)
    err = check(tmp_path, BASE, plugins)
    assert err.key == "channels" and "cannot convert float infinity" in err.rule


def no_daemon(monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(ctl, "control_call", lambda *a, **k: calls.append((a, k)) or {})
    return calls


@pytest.mark.parametrize("args, key, shown", [
    (["--deadline-ms", "inf"], "channels.standard.deadline_ms", "got `inf`"),
    (["--deadline-ms", "nan"], "channels.standard.deadline_ms", ""),
    (["--window-ms", "1e308"], "channels.standard.window_ms", "got `1e+308`"),
    (["--max-batch", "99999999999999999999"], "channels.standard.max_batch", "got `99999999999999999999`"),
    (["--max-batch", "0"], "channels.standard.max_batch", "got `0`"),
    (["--queue-limit", "-1"], "channels.standard.queue_limit", "got `-1`"),
])
def test_dynbatchctl_tune_refuses_out_of_range_values_in_one_line(monkeypatch, args, key, shown):
    calls = no_daemon(monkeypatch)
    result = CliRunner().invoke(ctl.app, ["--control", "ipc:///nowhere", "tune", "standard", *args])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and result.output.startswith("error: refused: "), result.output
    assert key in result.output and shown in result.output
    assert "Traceback" not in result.output and "OverflowError" not in result.output
    assert calls == []


def numeric_tune_options() -> list[tuple[str, object, object]]:
    """(--option, min, max) of every int or float option of `dynbatchctl tune`."""
    import typing

    import typer.main

    from dynbatchd.cli.tune import tune

    hints = typing.get_type_hints(tune)
    command = typer.main.get_command(ctl.app).commands["tune"]
    return [(p.opts[0], p.min, p.max) for p in command.params
            if p.opts[0].startswith("--") and {int, float} & {hints[p.name], *typing.get_args(hints[p.name])}]


def test_tune_has_numeric_options_to_check():
    assert {"--max-batch", "--window-ms", "--trials", "--canary-share", "--seed"} <= {o for o, _, _ in numeric_tune_options()}


@pytest.mark.parametrize("option, low, high", numeric_tune_options())
def test_every_numeric_tune_option_refuses_a_non_number_or_out_of_range_in_one_line(monkeypatch, option, low, high):
    calls = no_daemon(monkeypatch)
    values = ["abc", "1x"] + ([str(low - 1)] if low is not None else []) + ([str(high + 1)] if high is not None else [])
    for value in values:
        result = CliRunner().invoke(ctl.app, ["--control", "ipc:///nowhere", "tune", "standard", option, value])
        assert result.exit_code == 2, (value, result.output)
        assert result.output.count("\n") == 1 and result.output.startswith("error: "), (value, result.output)
        assert option in result.output and "Traceback" not in result.output and "Usage" not in result.output
    assert calls == []


def test_other_usage_errors_are_one_line_too():
    result = CliRunner().invoke(ctl.app, ["--control", "ipc:///nowhere", "tune", "standard", "--no-such-option"])
    assert result.exit_code == 2 and result.output == "error: No such option: --no-such-option\n", result.output


def test_control_call_turns_an_unencodable_argument_into_a_dynbatchd_error(tmp_path):
    import zmq

    from dynbatchd.client import DynbatchdError, control_call

    listener = zmq.Context.instance().socket(zmq.ROUTER)   # something listens: the call gets as far as encoding
    listener.bind(f"ipc://{tmp_path}/ctl.sock")
    try:
        with pytest.raises(DynbatchdError) as info:
            control_call(f"ipc://{tmp_path}/ctl.sock", "tune", channel="x", max_batch=2**70)
    finally:
        listener.close(linger=0)
    assert "cannot send tune" in str(info.value)


# --- the control socket -----------------------------------------------------

@pytest.mark.parametrize("control", ["tcp://0.0.0.0:5556", "tcp://*:5556", "tcp://10.1.2.3:5556",
                                     "tcp://eth0:5556", "tcp://[::]:5556",
                                     # loopback too: any local user could connect and read `config`
                                     "tcp://127.0.0.1:5556", "tcp://[::1]:5556", "tcp://localhost:5556"])
def test_a_tcp_control_socket_without_curve_is_refused(tmp_path, plugins, control):
    err = check(tmp_path, BASE + f'[daemon]\ncontrol = "{control}"\n', plugins)
    assert err.key == "daemon.control" and "CURVE is off" in err.rule and "authentication" in err.rule
    assert "ipc://" in err.rule   # says what to use instead


@pytest.mark.parametrize("control", ["ipc:///run/dynbatchd/control.sock", "inproc://control"])
def test_a_control_socket_its_file_or_process_guards_is_accepted(tmp_path, plugins, control):
    validate_config(cfgmod.load(write(tmp_path, BASE + f'[daemon]\ncontrol = "{control}"\n')), plugins)


@pytest.mark.parametrize("listen, loopback", [("0.0.0.0:8080", False), (":8080", False), ("10.1.2.3:8080", False),
                                              ("[::]:8080", False), ("127.0.0.1:8080", True),
                                              ("[::1]:8080", True), ("localhost:8080", True)])
def test_the_http_door_needs_keys_with_curve_on_and_keys_and_tls_off_loopback(tmp_path, plugins, listen, loopback):
    text = (BASE + f'[daemon]\nlisten = "ipc://{tmp_path}/r"\ncontrol = "ipc://{tmp_path}/c"\ncurve = true\n'
            f'[http]\nlisten = "{listen}"\n')
    err = check(tmp_path, text, plugins)   # CURVE on, no HTTP keys: refused anywhere
    assert err.key == "http.keys" and "curve" in err.rule and "no API keys" in err.rule
    plain = text.replace("curve = true", "curve = false")
    if loopback:
        validate_config(cfgmod.load(write(tmp_path, plain)), plugins)
    else:   # off loopback: keys and TLS, with or without CURVE
        for extra in ("", "keys = true\n", 'tls_cert = "c.pem"\ntls_key = "k.pem"\n'):
            err = check(tmp_path, plain + extra, plugins)
            assert err.key == "http.listen" and "loopback" in err.rule and "TLS" in err.rule
    full = 'keys = true\ntls_cert = "c.pem"\ntls_key = "k.pem"\n'
    validate_config(cfgmod.load(write(tmp_path, text + full)), plugins)
    validate_config(cfgmod.load(write(tmp_path, plain + full)), plugins)
    err = check(tmp_path, plain + 'tls_cert = "c.pem"\n', plugins)
    assert err.key == "http.tls_key" and "together" in err.rule


def test_check_config_refuses_a_tcp_control_socket_without_curve_in_one_line(tmp_path):
    bad = write(tmp_path, BASE + '[daemon]\ncontrol = "tcp://127.0.0.1:5556"\n')
    for args in (["check-config", str(bad)], ["start", "--config", str(bad)]):
        result = CliRunner().invoke(daemon_app, args)
        assert result.exit_code == 2, result.output
        assert result.output.startswith("error: ") and result.output.count("\n") == 1
        assert "daemon.control" in result.output and "CURVE is off" in result.output


# --- one line per error -----------------------------------------------------

LONG_NAME = "a_channel_whose_name_is_long_enough_to_push_the_message_past_eighty_columns"


def test_config_errors_are_never_wrapped(tmp_path, monkeypatch):
    monkeypatch.delenv("DYNBATCHD_CONFIG", raising=False)
    # the channel's window over its deadline: refused wherever the file is read, plugins loaded or not
    bad = write(tmp_path, BASE.replace("[channels.standard]", f"[channels.{LONG_NAME}]")
                + "deadline_ms = 5\n" + f"[routing]\ndefault = '{LONG_NAME}'\n", name="bad.toml")
    runs = [
        (daemon_app, ["check-config", str(bad)]),
        (daemon_app, ["start", "--config", str(bad)]),
        (ctl.app, ["--config", str(bad), "status"]),
        (ctl.app, ["simulate", "--config", str(bad)]),
        (ctl.app, ["plan", "--config", str(bad.parent / "missing.toml"), "--memory-gb", "8"]),
    ]
    for app, args in runs:
        result = CliRunner().invoke(app, args, env={"COLUMNS": "80"}, terminal_width=80)
        assert result.exit_code == 2, (args, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and len(lines[0]) > 80 and lines[0].startswith("error: "), (args, result.output)


# --- metrics_listen: one default --------------------------------------------

def test_metrics_listen_has_one_default_everywhere():
    default = cfgmod.DaemonSettings().metrics_listen
    page = (REPO / "man" / "dynbatchd.toml.5.rst").read_text()
    assert f'``metrics_listen`` (string, default ``{json.dumps(default)}``)' in page
    shipped = (REPO / "etc" / "dynbatchd.toml").read_text()
    assert f"The default is {json.dumps(default)}" in shipped
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"off by default (`{json.dumps(default)}`)" in readme
    assert cfgmod.load(REPO / "etc" / "dynbatchd.toml").daemon.metrics_listen == "127.0.0.1:9464"
    assert "127.0.0.1:9464" in readme
