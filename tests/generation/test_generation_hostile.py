"""Faults a hostile pass over ZeroMQ found in a live generative daemon, each with the test that
failed before its fix: one prompt the model cannot run failed every stream of the model; a
streaming client that left was generated for until its max_new_tokens; generate jobs ignored their
channel's queue_limit (each waiting one costs every step its look: 100,000 added 126 ms a token).

One daemon for the module: the tiny model with no end token (every answer runs to its length), a
4,096-token context, and a tokenizer that knows one word ("zzz") the model has no embedding for,
so a prompt holding it makes the forward pass raise (IndexError), as a real model's bad input does.
"""

from __future__ import annotations

import json

import msgspec
import pytest
import zmq

pytest.importorskip("transformers")

from conftest import start_daemon, wait_until  # noqa: E402

from dynbatchd import protocol as P  # noqa: E402

pytestmark = pytest.mark.e2e
POISON = "zzz"


def poison_tokenizer(path, word=POISON):
    """Give the tokenizer a word whose id is past the model's vocabulary (its embedding raises)."""
    file = path / "tokenizer.json"
    tokenizer = json.loads(file.read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab[word] = max(vocab.values()) + 50
    file.write_text(json.dumps(tokenizer))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from dynbatchd.generation.tinymodel import build_tiny_causal_lm

    path = build_tiny_causal_lm(tmp_path_factory.mktemp("hostile") / "tiny", eos=False, max_positions=4096)
    poison_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_dir):
    daemon = start_daemon(tmp_path_factory.mktemp("hostiled"), f"""
        [models.tiny]
        runner = "causal-lm"
        options = {{ path = "{model_dir}", max_new_tokens = 12, kv_budget_tokens = 9000 }}
        [channels.standard]
        max_batch = 8
        window_ms = 0
        deadline_ms = 120000
        [channels.narrow]
        max_batch = 8
        window_ms = 0
        deadline_ms = 120000
        queue_limit = 2
        [routing]
        default = "standard"
        [[routing.rules]]
        tag = "narrow"
        channel = "narrow"
    """, cpu_threads=1)
    yield daemon
    daemon.stop()


@pytest.fixture
def sock(served):
    s = connect(served)
    yield s
    s.close()


def connect(daemon):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(daemon.endpoint)
    return s


def send(sock, rid, text, **extra):
    sock.send(msgspec.msgpack.encode({"id": rid, "model": "tiny", "text": text, **extra}))


def frame(sock):
    assert sock.poll(60_000), "no frame within 60 s"
    return msgspec.msgpack.decode(sock.recv_multipart()[0])


def until_final(sock, ids, chunks=None):
    """Frames for `ids` until each has its final one: (chunks by id, finals by id, finals' order)."""
    chunks, finals, order = chunks or {i: [] for i in ids}, {}, []
    while len(finals) < len(ids):
        got = frame(sock)
        assert got["id"] not in finals, "a frame after the final one"
        if "ok" in got:
            finals[got["id"]] = got
            order.append(got["id"])
        else:
            chunks[got["id"]].append(got)
    return chunks, finals, order


def first_chunks(sock, ids):
    """Read until each of `ids` sent a chunk (none may end first): the chunks by id."""
    chunks = {i: [] for i in ids}
    while not all(chunks.values()):
        got = frame(sock)
        assert "ok" not in got, got
        chunks[got["id"]].append(got)
    return chunks


def alone(model_dir, prompt, n):
    from dynbatchd.devices.causal_lm import CausalLMRunner

    runner = CausalLMRunner("cpu", {"path": str(model_dir)})
    runner.load()
    runner.add("one", prompt, max_new_tokens=n)
    runner.prefill(["one"])
    while not runner.sequences["one"].finished:
        runner.decode_step(["one"])
    return runner.remove("one").text


def settled(daemon):
    """Nothing generating and no KV held (polled: the worker's last end may still be on its way)."""
    def idle():
        generation = daemon.status()["generation"]
        return generation["running"] == 0 and generation["kv_in_use_tokens"] == 0 and generation
    return wait_until(idle, 60, message="generation did not settle")


def test_a_prompt_the_model_cannot_run_fails_alone_beside_three_streams(served, sock, model_dir):
    """Its prefill raised and the worker ended every job of the model model_error; now the step is
    run again one sequence at a time, and only the poisoned prompt fails."""
    expected = alone(model_dir, "w41 w42", 300)
    for rid in range(3):
        send(sock, rid, "w41 w42", stream=True, generate={"max_new_tokens": 300})
    chunks = first_chunks(sock, range(3))
    send(sock, "poison", f"w41 {POISON} w42", stream=True, generate={"max_new_tokens": 5})
    chunks["poison"] = []
    chunks, finals, order = until_final(sock, list(chunks), chunks)
    poison = finals["poison"]
    assert not poison["ok"] and poison["error"]["code"] == P.MODEL_ERROR and "IndexError" in poison["error"]["message"]
    for rid in range(3):
        assert finals[rid]["ok"], finals[rid]
        assert "".join(c["text"] for c in chunks[rid]) == expected
    assert order[0] == "poison", "the streams ended before the poisoned prompt ran: the test proves nothing"
    assert settled(served)["ended"].get("error") == 1


def test_a_streaming_client_that_leaves_has_its_generation_withdrawn(served):
    """Its chunks went nowhere while the worker generated on to max_new_tokens; the first chunk
    ZeroMQ refuses (ROUTER_MANDATORY: the peer left) now withdraws it, and its KV is freed."""
    before = served.status()["generation"]["ended"].get("cancelled", 0)
    leaving = connect(served)
    send(leaving, "gone", "w43 w44", stream=True, generate={"max_new_tokens": 4000})
    frame(leaving)
    leaving.close()
    generation = settled(served)
    assert generation["ended"].get("cancelled", 0) == before + 1
    assert "a chunk could not be delivered (its client left): withdrawn" in served.log.read_text(errors="replace")


def test_generate_jobs_beyond_the_channels_queue_limit_are_overloaded(served, sock):
    """queue_limit = 2: two long streams in flight, three more are refused at once (they were all
    accepted and waited in the worker, every one looked at each step)."""
    for rid in ("a", "b"):
        send(sock, rid, "w45 w46", stream=True, tags=["narrow"], generate={"max_new_tokens": 3000})
    chunks = first_chunks(sock, ["a", "b"])
    for rid in ("c", "d", "e"):
        send(sock, rid, "w45 w46", stream=True, tags=["narrow"], generate={"max_new_tokens": 5})
    refused = {}
    while len(refused) < 3:
        got = frame(sock)
        if "ok" in got:
            refused[got["id"]] = got
        else:
            chunks.setdefault(got["id"], []).append(got)
    assert set(refused) == {"c", "d", "e"}, refused
    for got in refused.values():
        assert not got["ok"] and got["error"]["code"] == P.OVERLOADED, got
        assert "queue is full (2 generating or waiting)" in got["error"]["message"]
    assert served.status()["channels"]["narrow"]["rejected"]["overloaded"] == 3
    for rid in ("a", "b"):
        sock.send(msgspec.msgpack.encode({"id": rid, "cancel": True}))
    _, finals, _ = until_final(sock, ["a", "b"], chunks)
    assert all(f["error"]["code"] == P.CANCELLED for f in finals.values())
    settled(served)
    send(sock, "after", "w45 w46", tags=["narrow"], generate={"max_new_tokens": 3})   # the room is back
    assert until_final(sock, ["after"])[1]["after"]["ok"]


def test_no_prompt_reached_the_log(served):
    log = served.log.read_text(errors="replace")
    assert not any(word in log for word in ("w41 w42", "w43 w44", "w45 w46", POISON))
