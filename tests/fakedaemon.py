"""A stand-in daemon for the client library's tests (`Fake`): a ROUTER socket on a thread answers
each request with whatever frames a test scripts. `fake_daemons` backs the `fake` fixtures."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import msgspec
import zmq

Respond = Callable[[dict], list[list[bytes]]]


def frame(header: dict) -> bytes:
    return msgspec.msgpack.encode(header)


def ok(req_id: Any, value: Any) -> list[bytes]:
    return [frame({"id": req_id, "ok": True, "value": value})]


class Fake:
    """A stand-in daemon: a ROUTER socket on a thread; `respond(request header)` gives the messages
    (lists of frames, after the envelope) to send back. Every request header is kept in `seen`."""

    def __init__(self, endpoint: str, respond: Respond):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = endpoint
        self.sock.bind(self.endpoint)
        self.respond = respond
        self.seen: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            who, raw, *_ = self.sock.recv_multipart()
            header = msgspec.msgpack.decode(raw)
            self.seen.append(header)
            for message in self.respond(header):
                self.sock.send_multipart([who, *message])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


def fake_daemons(tmp_path: Path) -> Iterator[Callable[["Respond"], "Fake"]]:
    """`start(respond)` starts a Fake; all are closed when the generator ends (a fixture's teardown)."""
    started: list[Fake] = []

    def start(respond: Respond) -> Fake:
        started.append(Fake(f"ipc://{tmp_path}/fake{len(started)}.sock", respond))
        return started[-1]

    yield start
    for f in started:
        f.close()
