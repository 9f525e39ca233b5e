"""Fixtures that run the real daemon in a subprocess over real (ipc://) sockets.

The daemon is started by the one launcher the benchmarks use too (tests/launcher.py:
`Daemon`, `wait_until`); `start_daemon` writes the tests' config around a body and waits
until it serves. Every test that starts a daemon (a fixture or a call of `start_daemon`,
`Daemon`, `RunningDaemon` or `ipc_daemon`) is marked `e2e`, so `pytest -m "not e2e"` runs
the fast half.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
# tests/launcher.py, tests/helpers.py (callable runners), the repo; and each folder of tests (named as
# the package's parts are: engine/, scheduler/, devices/ ...), so that a test may reuse another's
# fixtures by module name (`from test_engine import engine`) wherever the two live.
_FOLDERS = sorted(str(p) for p in TESTS.iterdir() if p.is_dir() and p.name.isidentifier() and p.name != "__pycache__")
for _path in (str(REPO), str(TESTS), *_FOLDERS):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from launcher import Daemon, WaitTimeout, free_port, wait_until  # noqa: E402

RunningDaemon = Daemon   # .proc .endpoint .control .config .log .call() .status() .logs() .stop()

__all__ = ["REPO", "Daemon", "RunningDaemon", "SIMULATED", "MINILM", "WaitTimeout", "free_port", "start_daemon", "wait_until"]


def start_daemon(tmp: Path, body: str, *, ready_timeout: float = 180, daemon_extra: str = "",
                 devices_extra: str = "", devices: tuple[str, ...] = ("cpu",), cpu_threads: int = 2) -> RunningDaemon:
    """Write a config (endpoints in `tmp`, workers on `devices`) plus `body`, start dynbatchd, wait until it serves."""
    endpoint, control = f"ipc://{tmp}/req.sock", f"ipc://{tmp}/ctl.sock"
    if "state_dir" not in daemon_extra:   # the sketch and the audit log stay out of the checkout
        daemon_extra += f'\nstate_dir = "{tmp}/state"'
    config = textwrap.dedent(f"""
        [daemon]
        listen = "{endpoint}"
        control = "{control}"
        drain_timeout_s = 20
        {daemon_extra}
        [devices]
        use = {list(devices)!r}
        cpu_threads = {cpu_threads}
        {devices_extra}
    """) + textwrap.dedent(body)
    daemon = Daemon(Path(tmp) / "dynbatchd.toml", endpoint, control, config_text=config,
                    log=Path(tmp) / "daemon.log", pythonpath=[TESTS, REPO])
    return daemon.start(ready_timeout)


def start_tiny_generative(tmp: Path, model_dir: Path | str, *, kv_budget_tokens: int = 400,
                          extra: str = "") -> RunningDaemon:
    """A daemon serving the bundled tiny causal LM (`model_dir`, `build_tiny_causal_lm`) as ``tiny``,
    12 new tokens at most, one channel of 8 with no window; `extra`: more of the config (``[http]``)."""
    return start_daemon(tmp, f"""
        [models.tiny]
        runner = "causal-lm"
        options = {{ path = "{model_dir}", max_new_tokens = 12, kv_budget_tokens = {kv_budget_tokens} }}
        [channels.standard]
        max_batch = 8
        window_ms = 0
        deadline_ms = 60000
        [routing]
        default = "standard"
    """ + textwrap.dedent(extra), cpu_threads=1)


def start_tiny_generative_http(tmp: Path) -> RunningDaemon:
    """`start_tiny_generative` on a tiny model built in `tmp`, with its HTTP door on a free port
    (the daemon's `port`)."""
    from dynbatchd.generation.tinymodel import build_tiny_causal_lm

    port = free_port()
    daemon = start_tiny_generative(tmp, build_tiny_causal_lm(tmp / "tiny"),
                                   extra=f'[http]\nlisten = "127.0.0.1:{port}"\n')
    daemon.port = port
    return daemon


SIMULATED = """
    [models.sim]
    runner = "simulated"
    options = { base_ms = 2.0, per_item_ms = 0.1 }
    [models.echo]
    runner = "callable"
    options = { target = "helpers:echo_or_fail" }
    [channels.standard]
    max_batch = 16
    window_ms = 5
    deadline_ms = 5000
    queue_limit = 4096
    [channels.realtime]
    max_batch = 8
    window_ms = 1
    deadline_ms = 1000
    [channels.vault]
    max_batch = 8
    window_ms = 5
    isolated = true
    [routing]
    default = "standard"
    [[routing.rules]]
    tag = "urgent"
    channel = "realtime"
    [[routing.rules]]
    tag = "banking"
    channel = "vault"
"""

MINILM = """
    [models.minilm]
    runner = "sentence-embedding"
    [channels.standard]
    max_batch = 32
    window_ms = 20
    deadline_ms = 60000
    queue_limit = 8192
    [routing]
    default = "standard"
"""


# What starting a daemon subprocess looks like in a test, a fixture or a helper of its module.
STARTS_DAEMON = re.compile(r"\bstart_daemon\(|\bDaemon\(|\bRunningDaemon\(|\bipc_daemon\(|"
                           r"\b(sim|minilm)_daemon\b|\"dynbatchd\", \"start\"")


def _starts_daemon(func, module, seen: set) -> bool:
    """Whether `func` starts a daemon: its source says so, or a function of its module it names does."""
    if func in seen:
        return False
    seen.add(func)
    try:
        if not Path(inspect.getsourcefile(func) or "").resolve().is_relative_to(TESTS):
            return False   # pytest's own fixtures (tmp_path, monkeypatch) start nothing
        source = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError, SyntaxError):
        return False
    if STARTS_DAEMON.search(source):
        return True
    names = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    return any(inspect.isfunction(getattr(module, name, None)) and getattr(module, name).__module__ == module.__name__
               and _starts_daemon(getattr(module, name), module, seen) for name in names)


def pytest_collection_modifyitems(config, items):
    """Mark `e2e` every test that starts a daemon subprocess (itself, by a helper, or by a fixture)."""
    verdicts: dict = {}
    for item in items:
        function = getattr(item, "function", None)
        if function is None:
            continue
        funcs = [function] + [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
        module = item.module
        if any(verdicts.setdefault(f, _starts_daemon(f, inspect.getmodule(f) or module, set())) for f in funcs):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def sim_daemon(tmp_path_factory):
    port = free_port()
    daemon = start_daemon(tmp_path_factory.mktemp("sim"), SIMULATED,
                          daemon_extra=f'metrics_listen = "127.0.0.1:{port}"')
    daemon.metrics_url = f"http://127.0.0.1:{port}/metrics"
    yield daemon
    daemon.stop()


@pytest.fixture(scope="session")
def minilm_daemon(tmp_path_factory):
    daemon = start_daemon(tmp_path_factory.mktemp("minilm"), MINILM)
    yield daemon
    daemon.stop()
