"""Reloads that add and remove a model, under HTTP load and client hang-ups, end to end.

Soaks counted 503s during such runs. None came from a reload: requests for the model no reload
touched are all answered 200 while reloads (SIGHUP) add and remove another, and clients reset
their connections mid-request; the one being added or removed is 200 or 404 (unknown_model:
still loading, or removed). 503 is the answer of a daemon stopping (shutting_down, with
Retry-After), which a soak sees when it stops the daemon with its clients still sending.
"""

from __future__ import annotations

import collections
import http.client
import json
import signal
import socket
import struct
import threading

from conftest import free_port, start_daemon, wait_until

MODELS = {"a": '[models.a]\nrunner = "callable"\noptions = { target = "helpers:embed" }\n',
          "b": '[models.b]\nrunner = "callable"\noptions = { target = "helpers:embed" }\n'}
REST = ('[channels.standard]\nmax_batch = 16\nwindow_ms = 2\n[routing]\ndefault = "standard"\n'
        '[http]\nlisten = "127.0.0.1:%d"\n')
RELOADS = 6


class Clients:
    """Keep-alive clients asking for models a and b in turn, and one that resets its connections
    mid-request; each answer's (model, status, code) counted."""

    def __init__(self, port: int):
        self.port, self.stopping = port, threading.Event()
        self.answers: collections.Counter = collections.Counter()
        self.threads = [threading.Thread(target=self._ask, args=(m,)) for m in "aab"]
        self.threads.append(threading.Thread(target=self._hang_up))

    def __enter__(self) -> "Clients":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(60)

    def _ask(self, model: str) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        body = json.dumps({"model": model, "input": ["one", "two words"]})
        while not self.stopping.is_set():
            connection.request("POST", "/v1/embeddings", body, {"content-type": "application/json"})
            reply = connection.getresponse()
            answer = json.loads(reply.read())
            self.answers[model, reply.status, answer["error"]["code"] if reply.status != 200 else "ok"] += 1

    def _hang_up(self) -> None:
        body, whole = json.dumps({"model": "a", "input": ["x"] * 8}).encode(), False
        while not self.stopping.is_set():
            whole = not whole   # the whole body (reset awaiting the answer), else half of it
            with socket.create_connection(("127.0.0.1", self.port)) as sock:
                sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
                             + (body if whole else body[: len(body) // 2]))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # a reset
            self.answers["hang-ups"] += 1

    def count(self, model: str) -> int:
        return sum(n for key, n in self.answers.items() if key[0] == model)


def test_reloads_adding_and_removing_a_model_refuse_no_request_for_an_untouched_one(tmp_path):
    port = free_port()
    daemon = start_daemon(tmp_path, MODELS["a"] + MODELS["b"] + REST % port)
    head = daemon.config.read_text().split("[models.")[0]
    try:
        with Clients(port) as clients:
            for n in range(RELOADS):
                seen = clients.count("a")
                with_b = n % 2 == 1
                daemon.config.write_text(head + MODELS["a"] + (MODELS["b"] if with_b else "") + REST % port)
                daemon.proc.send_signal(signal.SIGHUP)
                wait_until(lambda: ("b" in daemon.status()["models"]["serving"]) == with_b, 30,
                           message=f"reload {n} never applied")
                wait_until(lambda: clients.count("a") > seen + 20 and clients.answers["hang-ups"] > n, 30,
                           message="no load after the reload")
    finally:
        assert daemon.stop() == 0, daemon.log_tail()
    answers = clients.answers
    assert {k for k in answers if k[0] == "a"} == {("a", 200, "ok")}, answers
    assert {k for k in answers if k[0] == "b"} <= {("b", 200, "ok"), ("b", 404, "unknown_model")}, answers
    assert " ERROR " not in daemon.logs() and "Traceback" not in daemon.logs()
