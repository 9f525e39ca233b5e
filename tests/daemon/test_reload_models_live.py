"""A reload that adds and removes models and channels under a steady load, end to end: the daemon
in a subprocess over real sockets, one client (a raw DEALER socket, so a reply sent twice would be
seen) keeping models a and c busy on channel x and asking for model b all along.

The config file is rewritten twice: first it adds model b and channel y (requests for b are
refused unknown_model until the daemon says b is loaded, then served in y), then it removes
channel x and model c (requests for a move to channel z; those for c sent after the reload are
refused unknown_model, those sent before it are all served). Every request gets exactly one reply.
"""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from dynbatchd import protocol as P

from conftest import start_daemon, wait_until

MODELS = {
    "a": 'runner = "simulated"\noptions = { base_ms = 1.0, per_item_ms = 0.05 }',
    "b": 'runner = "noop"',
    "c": 'runner = "noop"',
}
CHANNEL = "max_batch = 16\nwindow_ms = 2\ndeadline_ms = 20000\nqueue_limit = 4096"


def body(models, channels, default, rules=""):
    text = "".join(f"[models.{m}]\n{MODELS[m]}\n" for m in models)
    text += "".join(f"[channels.{c}]\n{CHANNEL}\n" for c in channels)
    return text + f'[routing]\ndefault = "{default}"\n' + rules


B_RULE = '[[routing.rules]]\nmodel = "b"\nchannel = "y"\n'


class Load(threading.Thread):
    """Sends a, c and b in turn at a steady pace (at most `window` unanswered), and records each
    request's model and send time and every reply, by id."""

    def __init__(self, endpoint: str, window: int = 24):
        super().__init__(daemon=True)
        self.endpoint, self.window = endpoint, window
        self.sent: dict[int, tuple[str, float]] = {}
        self.replies: dict[int, list[P.Reply]] = {}
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:   # surfaced by the test
            self.error = exc

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        rid, models = 0, ("a", "c", "a", "b")
        try:
            while not self.stopping.is_set() or len(self.replies) < len(self.sent):
                if not self.stopping.is_set() and len(self.sent) - len(self.replies) < self.window:
                    rid += 1
                    model = models[rid % len(models)]
                    self.sent[rid] = (model, time.monotonic())
                    sock.send(msgspec.msgpack.encode({"id": rid, "model": model, "text": f"t{rid}"}))
                if sock.poll(1 if not self.stopping.is_set() else 30_000):
                    reply = P.reply_decoder.decode(sock.recv_multipart()[0])
                    self.replies.setdefault(reply.id, []).append(reply)
                elif self.stopping.is_set():
                    break   # 30 s without a reply: what is missing is reported by the test
            while sock.poll(300):   # anything more is a reply sent twice
                reply = P.reply_decoder.decode(sock.recv_multipart()[0])
                self.replies.setdefault(reply.id, []).append(reply)
        finally:
            sock.close(0)

    def answered(self, model: str) -> int:
        return sum(1 for rid, r in self.replies.items() if self.sent[rid][0] == model and r[0].ok)


def reload(daemon, text: str) -> tuple[dict, float, float]:
    daemon.config.write_text(text)
    before = time.monotonic()
    result = daemon.call("reload", timeout_s=30)
    return result, before, time.monotonic()


@pytest.mark.parametrize("feeders", [1, 2])
def test_reload_adds_and_removes_models_and_channels_under_load(tmp_path, feeders):
    daemon = start_daemon(tmp_path, body("ac", "xz", "x"), devices_extra=f"workers_per_device = {feeders}")
    head = daemon.config.read_text().split("[models.")[0]
    load = Load(daemon.endpoint)
    load.start()
    try:
        wait_until(lambda: load.answered("a") >= 50 and load.answered("c") >= 50, 30, message="no steady load")
        added, t_add, t_added = reload(daemon, head + body("abc", "xyz", "x", B_RULE))
        assert added["applied"] and added["needs_restart"] == []
        assert added["added"] == {"channels": ["y"], "models": ["b"]}
        assert added["removed"] == {"channels": [], "models": []}
        wait_until(lambda: "b" in daemon.status()["models"]["serving"], 20, message="model b never loaded")
        t_loaded = time.monotonic()
        wait_until(lambda: load.answered("b") >= 20, 20, message="model b not served after it loaded")
        a_before = load.answered("a")
        removed, t_remove, t_removed = reload(daemon, head + body("ab", "yz", "z", B_RULE))
        assert removed["applied"] and removed["needs_restart"] == []
        assert removed["added"] == {"channels": [], "models": []}
        assert removed["removed"] == {"channels": ["x"], "models": ["c"]}
        wait_until(lambda: load.answered("a") >= a_before + 50, 20, message="model a not served after the removal")
        def gone():
            status = daemon.status()
            return status if "x" not in status["channels"] and not status["models"]["unloading"] else None
        status = wait_until(gone, 20, message="channel x or model c never left")
        assert set(status["channels"]) == {"y", "z"} and status["models"]["serving"] == ["a", "b"]
    finally:
        load.stopping.set()
        load.join(60)
        logs = daemon.logs()
        daemon.stop()
    assert load.error is None, load.error
    assert not load.is_alive()

    doubled = {rid: len(r) for rid, r in load.replies.items() if len(r) > 1}
    lost = sorted(set(load.sent) - set(load.replies))
    assert not doubled, f"answered more than once: {doubled}"
    assert not lost, f"{len(lost)} requests never answered, e.g. {lost[:5]}"
    wrong = []
    for rid, (model, sent) in load.sent.items():
        reply = load.replies[rid][0]
        code = "ok" if reply.ok else reply.error.code
        if model == "a":
            expected = {"ok"}
        elif model == "b":
            expected = {"unknown_model"} if sent < t_add else {"ok"} if sent > t_loaded else {"ok", "unknown_model"}
        else:
            expected = {"ok"} if sent < t_remove else {"unknown_model"} if sent > t_removed else {"ok", "unknown_model"}
        if code not in expected:
            wrong.append((rid, model, code, reply.error.message if reply.error else ""))
        if model == "a" and reply.ok and sent > t_removed:
            assert reply.timing.channel == "z", (rid, reply.timing.channel)
    assert not wrong, f"{len(wrong)} unexpected replies, e.g. {wrong[:5]}"
    late_c = [rid for rid, (model, sent) in load.sent.items() if model == "c" and sent > t_removed]
    early_b = [rid for rid, (model, sent) in load.sent.items() if model == "b" and sent < t_add]
    assert late_c and early_b, "the load did not span both reloads"
    for phrase in ("added channel y", "added model b", "removed channel x", "removed model c",
                   "model b loaded", "model c unloaded"):
        assert phrase in logs, phrase
