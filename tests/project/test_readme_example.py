"""The README's Python example, exactly as written there (only its address swapped for the test
daemon's), run in a subprocess against a live daemon: it must print nothing on stderr. Leaving a
`with Client` block with requests in flight fails them with `ClientClosed`, quietly."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import REPO, start_daemon

BODY = """
    [models.minilm]
    runner = "simulated"
    options = { base_ms = 2.0, per_item_ms = 0.1 }
    [channels.standard]
    max_batch = 16
    window_ms = 5
    deadline_ms = 5000
    [channels.realtime]
    max_batch = 8
    window_ms = 1
    deadline_ms = 1000
    [routing]
    default = "standard"
    [[routing.rules]]
    tag = "urgent"
    channel = "realtime"
"""
ADDRESS = "tcp://127.0.0.1:5555"


def readme_example() -> str:
    (code,) = re.findall(r"^From Python:\n\n```python\n(.*?)^```", (REPO / "README.md").read_text(), re.S | re.M)
    return code


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)


def test_the_readme_python_example_runs_quietly(tmp_path):
    code = readme_example()
    assert ADDRESS in code
    daemon = start_daemon(tmp_path, BODY)
    try:
        done = run(code.replace(ADDRESS, daemon.endpoint))
    finally:
        daemon.stop()
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.strip(), "the example prints its timing"


def test_leaving_a_client_with_requests_in_flight_is_quiet(tmp_path):
    """Nothing answers on this address: every request is still in flight when the block ends."""
    code = f"""
from dynbatchd.client import Client, ClientClosed
with Client("ipc://{tmp_path}/nobody.sock") as client:
    futures = [client.submit("minilm", t) for t in ["a", "b", "c"]]
for f in futures:
    assert isinstance(f.exception(timeout=10), ClientClosed), f.exception()
print("closed")
"""
    done = run(code)
    assert (done.returncode, done.stdout, done.stderr) == (0, "closed\n", "")
