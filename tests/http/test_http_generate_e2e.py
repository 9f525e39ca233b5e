"""The OpenAI completions endpoints end to end: a real daemon with the tiny causal LM (built here,
offline) behind its HTTP door, spoken to over a real socket as an OpenAI client would."""

from __future__ import annotations

import http.client
import json

import pytest

from conftest import start_tiny_generative_http
from helpers import wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    daemon = start_tiny_generative_http(tmp_path_factory.mktemp("genhttp"))
    yield daemon
    daemon.stop()


def post(daemon, path: str, body: dict) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn.getresponse()


def events(reply: http.client.HTTPResponse) -> list:
    """Each SSE event's data, parsed, until [DONE] (kept as the string)."""
    out = []
    for line in reply:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            out.append(data.decode() if data == b"[DONE]" else json.loads(data))
            if data == b"[DONE]":
                break
    return out


def test_a_stream_over_sse_yields_the_text_of_the_whole_answer_and_a_hang_up_frees_the_kv(served):
    whole = post(served, "/v1/completions", {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 10})
    body = json.loads(whole.read())
    assert whole.status == 200, body
    text = body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] > 0 and body["choices"][0]["finish_reason"] in ("length", "stop")

    streamed = post(served, "/v1/completions", {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 10,
                                                "stream": True, "stream_options": {"include_usage": True}})
    assert streamed.status == 200 and streamed.getheader("content-type") == "text/event-stream"
    got = events(streamed)
    assert got[-1] == "[DONE]" and got[-2]["usage"] == body["usage"]
    assert "".join(e["choices"][0]["text"] for e in got[:-2]) == text

    chat = post(served, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w1"}],
                                                 "max_tokens": 4, "stream": True})
    got = events(chat)
    assert got[0]["object"] == "chat.completion.chunk" and got[0]["choices"][0]["delta"]["role"] == "assistant"
    assert got[-2]["choices"][0]["finish_reason"] in ("length", "stop")

    long = post(served, "/v1/completions", {"model": "tiny", "prompt": "w1 w2", "max_tokens": 300,
                                            "stop": ["<never>"], "stream": True})
    assert long.readline()   # the first event came: generation is under way
    long.close()             # the client hangs up
    status = wait_until(lambda: (g := served.status()["generation"])["ended"].get("cancelled") and g, 60,
                        message="the hang-up never cancelled the generation")
    assert status["running"] == 0 and status["kv_in_use_tokens"] == 0
    log = served.log.read_text(errors="replace")
    assert "w1 w2 w3" not in log and text not in log, "a prompt or a completion reached the log"
