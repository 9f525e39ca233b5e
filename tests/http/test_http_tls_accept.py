"""TLS connections count against ``[http] max_connections`` from their accept, their handshake
included. asyncio's TLS server shook hands before the door's callback could count: 200 TCP
connections that sent no ClientHello held 199 of the daemon's descriptors for header_timeout_s
each, with max_connections = 3, and a flood of them could take every one. Now the door accepts TLS
connections itself (`HttpConnections._listen_tls`): one beyond the bound is closed at once, with no
handshake (a TLS client cannot be sent a 429), and one warning says so per run of refusals.

End to end against a daemon serving HTTPS with a self-signed certificate (under uvloop, as it runs)."""

from __future__ import annotations

import http.client
import json
import socket
import ssl

import pytest

from conftest import free_port, start_daemon
from helpers import wait_until
from test_http_keys import BODY, self_signed
from test_http_slow_readers import sockets

REFUSED = "max_connections (3) open"


def start_tls_daemon(tmp, header_timeout_s: float):
    cert, key = self_signed(tmp)
    port = free_port()
    running = start_daemon(tmp, BODY + f'\n[http]\nlisten = "127.0.0.1:{port}"\nmax_connections = 3\n'
                                       f'header_timeout_s = {header_timeout_s}\n'
                                       f'tls_cert = "{cert}"\ntls_key = "{key}"\n')
    running.port, running.tls = port, ssl.create_default_context(cafile=str(cert))
    return running


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    running = start_tls_daemon(tmp_path_factory.mktemp("tlsaccept"), 600)
    yield running
    assert running.stop() == 0
    assert "Traceback" not in running.logs()


def https(daemon, timeout: float = 10) -> http.client.HTTPSConnection:
    return http.client.HTTPSConnection("127.0.0.1", daemon.port, context=daemon.tls, timeout=timeout)


def healthz(connection: http.client.HTTPSConnection) -> int:
    connection.request("GET", "/healthz")
    reply = connection.getresponse()
    reply.read()
    return reply.status


def served(daemon) -> bool:
    """Whether a new HTTPS connection is served (False: closed before its answer)."""
    connection = https(daemon)
    try:
        return healthz(connection) == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def closed_unanswered(port: int, timeout: float = 10) -> bool:
    """Whether a new TCP connection that sends nothing is closed by the door within `timeout`."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as raw:
        try:
            return raw.recv(1) == b""
        except ConnectionResetError:
            return True
        except (socket.timeout, TimeoutError):
            return False


def test_https_requests_in_a_row_on_keep_alive_and_on_new_connections_are_served(daemon):
    """Each client sends its ClientHello as it connects (none may be lost to a plain read)."""
    connection = https(daemon)
    try:
        for _ in range(40):
            assert healthz(connection) == 200
        first = connection.sock
        body = json.dumps({"model": "enc", "input": "one two"})
        for _ in range(10):
            connection.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
            reply = connection.getresponse()
            assert reply.status == 200 and json.loads(reply.read())["data"][0]["embedding"] == [7.0, 2.0, 1.0]
        assert connection.sock is first   # all on one connection
    finally:
        connection.close()
    for _ in range(60):
        assert served(daemon)


def test_connections_awaiting_their_handshake_count_and_those_beyond_are_closed_at_once(daemon):
    before = sockets(daemon.pid)
    silent = [socket.create_connection(("127.0.0.1", daemon.port), timeout=10) for _ in range(3)]
    try:
        for _ in range(10):   # each beyond the three closed at once, not after header_timeout_s (600 s)
            assert closed_unanswered(daemon.port), "a connection beyond max_connections waited for its handshake"
        with pytest.raises((ssl.SSLError, ConnectionError)):   # a TLS client too: no handshake
            https(daemon).connect()
        assert sockets(daemon.pid) <= before + 3
        assert daemon.logs().count(REFUSED) == 1   # one line for the run of refusals
        silent.pop().close()
        wait_until(lambda: served(daemon), 30, message="a closed connection's place was not freed")
    finally:
        for sock in silent:
            sock.close()


def test_connections_that_never_shake_hands_are_closed_at_header_timeout_s(tmp_path):
    running = start_tls_daemon(tmp_path, 1.0)
    silent = []
    try:
        silent = [socket.create_connection(("127.0.0.1", running.port), timeout=60) for _ in range(3)]
        for sock in silent:
            try:
                assert sock.recv(1) == b""
            except ConnectionResetError:
                pass
        wait_until(lambda: served(running), 30, message="the timed-out connections' places were not freed")
    finally:
        for sock in silent:
            sock.close()
        assert running.stop() == 0
    assert "Traceback" not in running.logs()
