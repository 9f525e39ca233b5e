"""Faults a fuzzing pass over the metrics port found, end to end: a daemon in a subprocess, its
``[daemon] metrics_listen`` scraped over a real socket.

- ``HEAD /metrics`` was 404 with a body after its head (bytes a client reads as the next answer);
  other methods were 404 as for a path that does not exist.
- The exposition stays valid (`promtool check metrics`, where installed) with tenant names of
  quotes, backslashes, newlines, control characters and unicode."""

from __future__ import annotations

import shutil
import socket
import subprocess

import pytest

from conftest import SIMULATED, free_port, start_daemon
from dynbatchd.client import Client
from helpers import wait_until

ODD_TENANTS = ['q"uote', "back\\slash", "new\nline", "cr\rret", "tab\tx", "nul\x00x", "uni\u2028sep",
               "é€😀", "trail\\", '}{ a"} 1\nfake_metric 2']


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metricsfuzz")
    port = free_port()
    running = start_daemon(tmp, SIMULATED, daemon_extra=f'metrics_listen = "127.0.0.1:{port}"', cpu_threads=1)
    running.metrics_port = port
    yield running
    running.stop()


def exchange(daemon, request: bytes) -> bytes:
    """Send `request` raw and read the answer to the close (bounded by the socket's timeout)."""
    with socket.create_connection(("127.0.0.1", daemon.metrics_port), timeout=10) as connection:
        connection.sendall(request)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    return answer


def test_head_of_metrics_is_its_head_alone_and_other_methods_are_405(daemon):
    head, _, body = exchange(daemon, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n").partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and body == b""
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    assert length > 0   # the GET's length, as HEAD promises
    for method in (b"POST", b"PUT", b"DELETE", b"OPTIONS"):
        answer = exchange(daemon, method + b" /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 405") and b"\r\nAllow: GET, HEAD\r\n" in answer, method
    assert exchange(daemon, b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 404")
    assert exchange(daemon, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 200")


def test_odd_tenant_names_keep_the_exposition_valid(daemon):
    with Client(daemon.endpoint, timeout=30) as client:
        for tenant in ODD_TENANTS:
            client.infer("sim", ["x"], tenant=tenant)
    page = wait_until(lambda: (text := exchange(daemon, b"GET /metrics HTTP/1.1\r\n\r\n").partition(b"\r\n\r\n")[2])
                      .count(b"dynbatchd_tenant_requests_total{") >= len(ODD_TENANTS) and text, 10,
                      message="the tenants' series did not appear")
    assert b"\nfake_metric" not in page   # a newline in a label stays escaped
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed: the exposition's validity is not checked")
    check = subprocess.run(["promtool", "check", "metrics"], input=page, capture_output=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr


def test_slow_clients_cannot_hold_more_than_max_connections_of_the_metrics_port(daemon):
    """Connections each sending half a head (a slow-loris) were all held, each for the head timeout:
    enough of them took every file descriptor of the daemon. Beyond MAX_CONNECTIONS a connection is
    answered 503 at once; a scrape has room again once they go."""
    from dynbatchd.metrics import MAX_CONNECTIONS

    slow = [socket.create_connection(("127.0.0.1", daemon.metrics_port), timeout=10)
            for _ in range(MAX_CONNECTIONS)]
    try:
        for connection in slow:
            connection.sendall(b"GET /metrics HTTP/1.1\r\n")
        wait_until(lambda: exchange(daemon, b"").startswith(b"HTTP/1.1 503"), 4,   # (refused unread: send nothing)
                   message="a connection past MAX_CONNECTIONS slow ones was not refused")
    finally:
        for connection in slow:
            connection.close()
    wait_until(lambda: exchange(daemon, b"GET /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 200"), 10,
               message="the metrics port did not serve again once the slow connections closed")
    assert sum("further ones answered 503" in line for line in daemon.log_lines()) == 1
