"""The clients' streaming call and `dynbatchctl infer --stream`, against a scripted "daemon": a
ROUTER socket on a thread that answers a streamed request with the frames dynbatchd-protocol(7)
describes (chunks without `ok`, then one final reply), or holds it until the client cancels.
No model, no daemon process: the frames are what is tested here; tests/generation/
test_generation_daemon.py streams from a real daemon."""

from __future__ import annotations

import json
import threading

import msgspec
import pytest
import zmq
from typer.testing import CliRunner

from dynbatchd.cli.dynbatchctl import app
from dynbatchd.client import BadRequest, Client, Result
from dynbatchd.protocol import Chunk

PIECES = ["Once", " upon", " a time"]


class Scripted:
    """Answers each request by its text: "hold" waits for the client's cancel and answers it
    cancelled; "bad" is refused; anything else streams PIECES then a final reply. Every request
    header it got is kept in `seen`."""

    def __init__(self, tmp_path):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"ipc://{tmp_path}/scripted.sock"
        self.sock.bind(self.endpoint)
        self.seen: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def send(self, who: bytes, frame: dict) -> None:
        self.sock.send_multipart([who, msgspec.msgpack.encode(frame)])

    def serve(self) -> None:
        held: dict = {}
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            who, raw = self.sock.recv_multipart()
            req = msgspec.msgpack.decode(raw)
            self.seen.append(req)
            rid = req["id"]
            if req.get("cancel"):
                if rid in held:
                    self.send(who, {"id": rid, "ok": False, "error": {"code": "cancelled", "message": "cancelled"}})
                continue
            if req.get("text") == "hold":
                self.send(who, {"id": rid, "chunk": 0, "text": "first", "tokens": 1})
                held[rid] = who
            elif req.get("text") == "embed":   # a model that does not generate: one plain reply, no chunks
                self.send(who, {"id": rid, "ok": True, "value": [0.5, 0.25]})
            elif req.get("text") == "bad":
                self.send(who, {"id": rid, "ok": False, "error": {"code": "bad_request", "message": "too large"}})
            else:
                for n, piece in enumerate(PIECES):
                    self.send(who, {"id": rid, "chunk": n, "text": piece, "tokens": 1})
                value = {"finish_reason": "length", "output_tokens": 3, "prompt_tokens": 2}
                if not req.get("stream"):
                    value["text"] = "".join(PIECES)
                self.send(who, {"id": rid, "ok": True, "value": value,
                                "timing": {"ttft_us": 1500, "tpot_us": 250, "total_us": 2000, "channel": "c"}})

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def scripted(tmp_path):
    daemon = Scripted(tmp_path)
    yield daemon
    daemon.close()


def test_stream_yields_chunks_in_order_then_one_result(scripted):
    with Client(scripted.endpoint, timeout=20) as client:
        items = list(client.stream("tiny", "w1 w2", generate={"max_new_tokens": 3}))
    assert [type(i) for i in items] == [Chunk, Chunk, Chunk, Result]
    assert [c.chunk for c in items[:3]] == [0, 1, 2] and "".join(c.text for c in items[:3]) == "Once upon a time"
    final = items[-1]
    assert final.output == {"finish_reason": "length", "output_tokens": 3, "prompt_tokens": 2}
    assert final.timing.ttft_us == 1500 and final.timing.tpot_us == 250
    assert scripted.seen[0]["stream"] is True and scripted.seen[0]["generate"] == {"max_new_tokens": 3}


def test_a_plain_request_ignores_chunks_and_gets_the_text(scripted):
    with Client(scripted.endpoint, timeout=20) as client:
        result = client.infer_result("tiny", "w1", generate={"max_new_tokens": 3})
    assert result.output["text"] == "Once upon a time"
    assert "stream" not in scripted.seen[0]


def test_an_error_ends_the_stream_as_an_exception(scripted):
    with Client(scripted.endpoint, timeout=20) as client:
        with pytest.raises(BadRequest, match="too large"):
            list(client.stream("tiny", "bad"))


def test_leaving_a_stream_early_sends_a_cancel(scripted):
    with Client(scripted.endpoint, timeout=20) as client:
        for item in client.stream("tiny", "hold"):
            assert item.text == "first"
            break
        # the client keeps working; the cancel went out before this next request
        assert client.infer_result("tiny", "w1").output["finish_reason"] == "length"
    cancels = [r for r in scripted.seen if r.get("cancel")]
    assert cancels == [{"id": scripted.seen[0]["id"], "cancel": True}]


def test_dynbatchctl_infer_stream_prints_text_then_counts_and_json_lines(scripted):
    runner = CliRunner()
    human = runner.invoke(app, ["--endpoint", scripted.endpoint, "infer", "tiny", "w1 w2", "--stream",
                                "--tag", "urgent", "--request-type", "chat", "--tokens", "2"])
    assert human.exit_code == 0, human.output
    sent = scripted.seen[0]
    assert (sent["tags"], sent["request_type"], sent["tokens"], sent["stream"]) == (["urgent"], "chat", 2, True)
    assert human.output.startswith("Once upon a time\n") and "length: 3 tokens (prompt 2)" in human.output
    lines = runner.invoke(app, ["--endpoint", scripted.endpoint, "infer", "tiny", "w1", "--stream", "--json",
                                "--max-new-tokens", "3"])
    assert lines.exit_code == 0, lines.output
    frames = [json.loads(line) for line in lines.output.splitlines()]
    assert [f.get("chunk") for f in frames[:3]] == [0, 1, 2] and all("ok" not in f for f in frames[:3])
    assert frames[3]["ok"] is True and frames[3]["value"]["output_tokens"] == 3 and len(frames) == 4
    refused = runner.invoke(app, ["--endpoint", scripted.endpoint, "infer", "tiny", "bad", "--stream", "--json"])
    assert refused.exit_code == 1 and json.loads(refused.output)["error"]["code"] == "bad_request"


def test_async_client_streams_and_aclose_cancels(scripted):
    import asyncio
    from contextlib import aclosing

    from dynbatchd.asyncclient import AsyncClient

    async def main():
        async with AsyncClient(scripted.endpoint, timeout=20) as client:
            got = [item async for item in client.stream("tiny", "w1")]
            async with aclosing(client.stream("tiny", "hold")) as held:
                async for item in held:
                    assert item.text == "first"
                    break
            return got, await client.infer_result("tiny", "w1")

    got, after = asyncio.run(main())
    assert [c.text for c in got[:-1]] == PIECES and isinstance(got[-1], Result)
    assert after.output["text"] == "Once upon a time"
    assert [r["id"] for r in scripted.seen if r.get("cancel")] == [scripted.seen[1]["id"]]


def test_closing_right_after_leaving_a_stream_still_delivers_the_cancel(scripted):
    """dynbatchctl infer --stream on Ctrl-C: the stream is left and the client closed at once."""
    client = Client(scripted.endpoint, timeout=20)
    for _ in client.stream("tiny", "hold"):
        break
    client.close()
    scripted.stop.set()   # the scripted daemon reads what reached it, then stops
    scripted.thread.join(5)
    while scripted.sock.poll(2000):
        scripted.seen.append(msgspec.msgpack.decode(scripted.sock.recv_multipart()[1]))
    assert [r for r in scripted.seen if r.get("cancel")] == [{"id": scripted.seen[0]["id"], "cancel": True}]


def test_a_silent_stream_times_out_per_frame(scripted):
    from dynbatchd.client import Timeout

    with Client(scripted.endpoint, timeout=0.2) as client:
        got = []
        with pytest.raises(Timeout, match="nothing more of the stream"):
            for item in client.stream("tiny", "hold"):
                got.append(item.text)
    assert got == ["first"]


def test_dynbatchctl_infer_prints_a_whole_generation_as_text_and_counts(scripted):
    runner = CliRunner()
    human = runner.invoke(app, ["--endpoint", scripted.endpoint, "infer", "tiny", "w1", "--max-new-tokens", "3"])
    assert human.exit_code == 0, human.output
    assert human.output.startswith("Once upon a time\nlength: 3 tokens (prompt 2)")
    shown = runner.invoke(app, ["--endpoint", scripted.endpoint, "infer", "tiny", "w1", "--json"])
    data = json.loads(shown.output)
    assert data["output"]["text"] == "Once upon a time" and data["timing"]["ttft_ms"] == 1.5
    assert scripted.seen[0]["generate"] == {"max_new_tokens": 3} and "generate" not in scripted.seen[1]


def test_status_shows_generation_once_something_was_generated():
    from dynbatchd.cli.views import generation_lines

    assert generation_lines(None) == [] and generation_lines({"running": 0, "ended": {}}) == []
    lines = generation_lines({"running": 2, "kv_in_use_tokens": 812, "ended": {"length": 3, "cancelled": 1},
                              "generated_tokens": {"chat": 120},
                              "ttft": {"chat": {"p50_ms": 21.0, "p99_ms": 40.5}},
                              "tpot": {"chat": {"p50_ms": 1.25, "p99_ms": 3.5}}})
    assert lines == ["generation: 2 running, 812 KV tokens in use; ended 1 cancelled, 3 length",
                     "  chat: 120 tokens generated, first token p50 21.0 / p99 40.5 ms, per token p50 1.25 / p99 3.50 ms"]


def test_infer_stream_on_a_model_that_does_not_generate_prints_its_one_reply(scripted):
    runner = CliRunner()
    human = runner.invoke(app, ["--endpoint", scripted.endpoint, "infer", "minilm", "embed", "--stream"])
    assert human.exit_code == 0 and "not a generative model): [0.5, 0.25]" in human.output
    shown = runner.invoke(app, ["--endpoint", scripted.endpoint, "infer", "minilm", "embed", "--stream", "--json"])
    assert json.loads(shown.output)["value"] == [0.5, 0.25]
