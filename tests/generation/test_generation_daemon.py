"""A causal-lm model served end to end: one real daemon with the tiny model (built here, offline),
spoken to over ZeroMQ as a third-party client would (raw msgpack frames), several cases on it."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from conftest import start_tiny_generative

from dynbatchd import protocol as P

pytestmark = pytest.mark.e2e
PROMPTS = ["w1 w2 w3", "a b c d e", "w10 w20"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from dynbatchd.devices.causal_lm import CausalLMRunner
    from dynbatchd.generation.tinymodel import build_tiny_causal_lm

    tmp = tmp_path_factory.mktemp("gen")
    path = build_tiny_causal_lm(tmp / "tiny")
    runner = CausalLMRunner("cpu", {"path": str(path), "max_new_tokens": 12})
    runner.load()
    expected = {p: runner.generate([p])[0] for p in PROMPTS}   # one at a time, greedy
    daemon = start_tiny_generative(tmp, path, kv_budget_tokens=400)
    yield daemon, expected
    daemon.stop()


def connect(daemon):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    return sock


def frames_until_final(sock, ids):
    """Every frame for `ids` until each has its final one: (chunks by id, finals by id)."""
    chunks, finals = {i: [] for i in ids}, {}
    while len(finals) < len(ids):
        assert sock.poll(60_000), "no frame within 60 s"
        frame = msgspec.msgpack.decode(sock.recv_multipart()[0])
        assert frame["id"] not in finals, "a frame after the final one"
        if "ok" in frame:
            finals[frame["id"]] = frame
        else:
            chunks[frame["id"]].append(frame)
    return chunks, finals


def send(sock, rid, text, **extra):
    sock.send(msgspec.msgpack.encode({"id": rid, "model": "tiny", "text": text, **extra}))


def test_streams_equal_one_at_a_time_text_and_end_once(served):
    daemon, expected = served
    sock = connect(daemon)
    try:
        for rid, prompt in enumerate(PROMPTS):   # concurrent streams, batched together
            send(sock, rid, prompt, stream=True)
        chunks, finals = frames_until_final(sock, list(range(len(PROMPTS))))
        for rid, prompt in enumerate(PROMPTS):
            assert [c["chunk"] for c in chunks[rid]] == list(range(len(chunks[rid])))
            assert "".join(c["text"] for c in chunks[rid]) == expected[prompt]
            final = finals[rid]
            assert final["ok"] and "text" not in final["value"]
            assert final["value"]["finish_reason"] in ("length", "stop")
            assert final["value"]["prompt_tokens"] == len(prompt.split())
            assert final["timing"]["ttft_us"] > 0
        assert not sock.poll(300)
    finally:
        sock.close()


def test_a_request_not_streamed_gets_its_text_in_the_final_reply(served):
    daemon, expected = served
    sock = connect(daemon)
    try:
        send(sock, "plain", PROMPTS[1], generate={"max_new_tokens": 12})
        chunks, finals = frames_until_final(sock, ["plain"])
        assert chunks["plain"] == []
        assert finals["plain"]["value"]["text"] == expected[PROMPTS[1]]
    finally:
        sock.close()


def test_cancel_mid_stream_ends_cancelled_and_frees_the_kv(served):
    daemon, _ = served
    sock = connect(daemon)
    try:
        send(sock, 7, "w1 w2", stream=True, generate={"max_new_tokens": 300, "stop": ["<never>"]})
        assert sock.poll(60_000)
        first = msgspec.msgpack.decode(sock.recv_multipart()[0])
        assert first["chunk"] == 0 or not first.get("ok", True)
        sock.send(msgspec.msgpack.encode({"id": 7, "cancel": True}))
        _, finals = frames_until_final(sock, [7])
        assert finals[7]["ok"] is False and finals[7]["error"]["code"] == P.CANCELLED
        generation = daemon.status()["generation"]
        assert generation["running"] == 0 and generation["kv_in_use_tokens"] == 0
    finally:
        sock.close()


def test_bad_generate_keys_and_requests_that_never_fit_are_refused(served):
    daemon, _ = served
    sock = connect(daemon)
    try:
        send(sock, "big", "w1 " * 50, generate={"max_new_tokens": 390})
        send(sock, "key", "w1", generate={"max_tokens": 3})
        _, finals = frames_until_final(sock, ["big", "key"])
        assert finals["big"]["error"]["code"] == P.BAD_REQUEST and "KV budget" in finals["big"]["error"]["message"]
        assert finals["key"]["error"]["code"] == P.BAD_REQUEST and "generate.max_tokens" in finals["key"]["error"]["message"]
    finally:
        sock.close()


def test_the_python_client_and_dynbatchctl_stream_from_the_daemon(served):
    import json

    from typer.testing import CliRunner

    from dynbatchd.cli.dynbatchctl import app
    from dynbatchd.client import BadRequest, Client, Result

    daemon, expected = served
    with Client(daemon.endpoint, timeout=60) as client:
        items = list(client.stream("tiny", PROMPTS[0]))
    assert isinstance(items[-1], Result) and not any(isinstance(i, Result) for i in items[:-1])
    assert "".join(c.text for c in items[:-1]) == expected[PROMPTS[0]]
    assert items[-1].output["output_tokens"] == sum(c.tokens for c in items[:-1])
    with Client(daemon.endpoint, timeout=60) as client, pytest.raises(BadRequest, match="model's context"):
        list(client.stream("tiny", "w1", generate={"max_new_tokens": 1000}))   # the tiny model: 512 positions
    shown = CliRunner().invoke(app, ["--endpoint", daemon.endpoint, "infer", "tiny", PROMPTS[2], "--stream", "--json"])
    assert shown.exit_code == 0, shown.output
    frames = [json.loads(line) for line in shown.output.splitlines()]
    assert "".join(f["text"] for f in frames[:-1]) == expected[PROMPTS[2]]
    assert frames[-1]["ok"] is True and frames[-1]["timing"]["ttft_us"] > 0


def test_a_deadline_ends_a_generation_midway_and_frees_its_kv(served):
    daemon, _ = served
    sock = connect(daemon)
    try:   # 300 tokens cannot take under 5 ms: it ends by its deadline, at a token boundary
        send(sock, "late", "w1 w2", stream=True, deadline_ms=5, generate={"max_new_tokens": 300, "stop": ["<never>"]})
        _, finals = frames_until_final(sock, ["late"])
        assert finals["late"]["ok"] is False and finals["late"]["error"]["code"] == P.DEADLINE_EXCEEDED
        generation = daemon.status()["generation"]
        assert generation["running"] == 0 and generation["kv_in_use_tokens"] == 0
        assert generation["ended"]["deadline_exceeded"] == 1
    finally:
        sock.close()


def test_the_protocol_pages_streaming_client_runs_as_written(served, capsys):
    """dynbatchd-protocol(7) EXAMPLES' streaming client (pyzmq + msgpack only), run as printed
    there but for its model name and socket: a third-party client written from the page streams."""
    import re
    from pathlib import Path

    import msgpack

    daemon, expected = served
    page = (Path(__file__).resolve().parents[2] / "man" / "dynbatchd-protocol.7.rst").read_text()
    block = re.search(r"(?s)Streaming a generative model's answer.*?\.\. code-block:: python\n\n((?:(?:   [^\n]*)?\n)+)",
                      page)[1]
    code = "\n".join(line[3:] for line in block.splitlines())
    code = code.replace('"model": "llm", "text": "Once upon a time"', f'"model": "tiny", "text": "{PROMPTS[1]}"')
    code = code.replace('"max_new_tokens": 64', '"max_new_tokens": 12')   # as `expected` was made
    assert '"model": "tiny"' in code and '"max_new_tokens": 12' in code, "the page's example changed: update this test"
    sock = connect(daemon)
    try:
        exec(compile(code, "dynbatchd-protocol.7", "exec"), {"msgpack": msgpack, "sock": sock})
    finally:
        sock.close()
    text, end, _ = capsys.readouterr().out.split("\n")   # the text, then the final reply's line
    assert text == expected[PROMPTS[1]] and end.split()[0] in ("length", "stop") and int(end.split()[1]) > 0


def test_a_stop_drains_a_running_generation_to_its_end(served):
    """Last in this module: it stops the daemon. SIGTERM mid-stream: the stream still ends ok."""
    import signal

    daemon, _ = served
    sock = connect(daemon)
    try:
        send(sock, "drain", "w3 w4", stream=True, generate={"max_new_tokens": 40})
        assert sock.poll(60_000)
        first = msgspec.msgpack.decode(sock.recv_multipart()[0])
        daemon.proc.send_signal(signal.SIGTERM)
        chunks, finals = frames_until_final(sock, ["drain"])
        assert finals["drain"]["ok"] is True, finals["drain"]
        assert finals["drain"]["value"]["output_tokens"] >= len(chunks["drain"]) + ("ok" not in first)
        assert daemon.stop() == 0
        assert daemon.trouble == []                        # no error logged all module long
        log = daemon.log.read_text(errors="replace")
        assert not any(prompt in log for prompt in PROMPTS)   # prompts never reach the log
    finally:
        sock.close()
