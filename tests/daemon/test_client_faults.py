"""The client library against a hostile or odd "daemon" and odd use: a ROUTER socket on a thread
(`Fake`) answers each request with whatever frames a test scripts, and one test stops and
restarts a real daemon under a client. Each test fails (it does not hang) on a regression: every
wait is bounded.

What a caller may see is a `Result`, a `DynbatchdError` subclass (`Timeout` also a `TimeoutError`)
or its own `asyncio.CancelledError`; never an IndexError from a reply, a wait for ever, a thread or
a file descriptor left behind by a closed client, or a traceback from a background thread.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from concurrent.futures import CancelledError, wait

import pytest
import zmq

from dynbatchd.asyncclient import AsyncClient
from dynbatchd.client import (BadReply, BadRequest, Client, ClientClosed, CurveKeys, DynbatchdError, Result,
                              Timeout, control_call)
from dynbatchd.protocol import Chunk

from conftest import SIMULATED, start_daemon
from fakedaemon import fake_daemons, frame, ok
from helpers import wait_until

BOUND_S = 20   # every wait in this file: a regression fails here instead of hanging

@pytest.fixture
def fake(tmp_path):
    """`fake(respond)` starts a Fake; all are closed after the test."""
    yield from fake_daemons(tmp_path)


def echo(header: dict) -> list[list[bytes]]:
    return [] if header.get("cancel") else [ok(header["id"], header.get("text"))]


def silent(header: dict) -> list[list[bytes]]:
    return []


# --- hostile replies --------------------------------------------------------------------------------

TENSORS_THAT_DO_NOT_FIT = {
    "no frame": ({"dtype": "float32", "shape": [4]}, []),
    "object dtype": ({"dtype": "object", "shape": [1]}, [b"12345678"]),
    "size mismatch": ({"dtype": "float32", "shape": [4]}, [b"123"]),
    "negative frame": ({"dtype": "uint8", "shape": [3], "frame": -1}, [b"123"]),
}


@pytest.mark.parametrize("case", TENSORS_THAT_DO_NOT_FIT)
def test_a_tensor_reply_its_frames_cannot_hold_is_bad_reply(fake, case):
    tensor, frames = TENSORS_THAT_DO_NOT_FIT[case]
    server = fake(lambda h: [[frame({"id": h["id"], "ok": True, "tensor": tensor}), *frames]])
    with Client(server.endpoint, timeout=BOUND_S) as client:
        with pytest.raises(BadReply, match="unreadable reply"):
            client.infer("m", "x")
        with pytest.raises(BadReply):   # the final reply of a stream too
            list(client.stream("m", "x"))


def test_a_final_reply_with_a_field_of_the_wrong_type_fails_its_request_at_once(fake):
    server = fake(lambda h: [[frame({"id": h["id"], "ok": "yes"})]])
    with Client(server.endpoint, timeout=BOUND_S) as client:
        future = client.submit("m", "x")
        with pytest.raises(BadReply, match="ok"):   # not Timeout after BOUND_S
            future.result(timeout=BOUND_S / 2)
        stream = client.stream("m", "x")
        with pytest.raises(BadReply):
            next(stream)


def test_replies_for_no_one_unknown_codes_and_duplicates_reach_no_wrong_caller(fake):
    """Each request is answered by junk, a reply with no id, one for an unknown id, a chunk for it,
    then its own reply twice: 8 threads sharing a client each get their own answer, once."""
    def hostile(h):
        if h.get("cancel"):
            return []
        rid = h["id"]
        if h["text"] == "odd-code":
            return [[frame({"id": rid, "ok": False, "error": {"code": "from_the_future", "message": "new"}})]]
        return [[b"\xc1not msgpack"], [frame({"id": None, "ok": False})], ok(10**12, "stranger"),
                [frame({"id": rid, "chunk": 0, "text": "t", "tokens": 1})], ok(rid, h["text"]), ok(rid, "again")]

    server = fake(hostile)
    answers: dict[int, list] = {}
    with Client(server.endpoint, timeout=BOUND_S) as client:
        def caller(n: int) -> None:
            answers[n] = [client.infer("m", f"{n}-{i}") for i in range(25)]

        threads = [threading.Thread(target=caller, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(BOUND_S)
        with pytest.raises(DynbatchdError) as raised:
            client.infer("m", "odd-code")
    assert answers == {n: [f"{n}-{i}" for i in range(25)] for n in range(8)}
    assert type(raised.value) is DynbatchdError and raised.value.code == "from_the_future"


def test_a_stream_that_ends_twice_yields_one_result_and_later_frames_are_ignored(fake):
    def twice(h):
        if h.get("cancel"):
            return []
        rid = h["id"]
        chunk = [frame({"id": rid, "chunk": 0, "text": "a", "tokens": 1})]
        return [chunk, ok(rid, {"finish_reason": "length"}), ok(rid, {"finish_reason": "stop"}), chunk]

    server = fake(twice)
    with Client(server.endpoint, timeout=BOUND_S) as client:
        first = list(client.stream("m", "x"))
        second = list(client.stream("m", "y"))
        assert client._async._streams == {} and client._async._pending == {}
    assert [type(i) for i in first] == [type(i) for i in second] == [Chunk, Result]
    assert first[-1].output == {"finish_reason": "length"}


def test_a_stream_that_never_ends_times_out_and_is_withdrawn(fake):
    server = fake(lambda h: [] if h.get("cancel") else [[frame({"id": h["id"], "chunk": 0, "text": "a", "tokens": 1})]])
    with Client(server.endpoint, timeout=0.3) as client:
        stream = client.stream("m", "x")
        assert isinstance(next(stream), Chunk)
        with pytest.raises(Timeout):
            next(stream)
        wait_until(lambda: {"id": 1, "cancel": True} in server.seen, BOUND_S, message="no cancel sent")


# --- what the caller sends and asks ---------------------------------------------------------------

@pytest.mark.parametrize("inputs", [2**70, object(), "\ud800", {"k": object()}],
                         ids=["int", "object", "surrogate", "nested"])
def test_an_input_msgpack_cannot_carry_is_bad_request_and_leaves_nothing_pending(fake, inputs):
    server = fake(echo)
    with Client(server.endpoint, timeout=BOUND_S) as client:
        with pytest.raises(BadRequest, match="cannot send this request"):
            client.infer("m", inputs)
        with pytest.raises(BadRequest):
            list(client.stream("m", inputs))
        assert client._async._pending == {} and client._async._streams == {}
        assert client.infer("m", "fine") == "fine"
    assert [h["text"] for h in server.seen] == ["fine"]


@pytest.mark.parametrize("tags", ["urgent", 5, [1]], ids=["a-string", "a-number", "not-strings"])
def test_tags_that_are_not_a_list_of_strings_are_bad_request_before_sending(fake, tags):
    """tags="urgent" once went out as six one-letter tags, so the request was routed as untagged."""
    server = fake(echo)
    with Client(server.endpoint, timeout=BOUND_S) as client:
        with pytest.raises(BadRequest, match="tags takes a list of strings"):
            client.infer("m", "x", tags=tags)
        assert client.infer("m", "fine", tags=["urgent"]) == "fine"
    assert [h.get("tags") for h in server.seen] == [["urgent"]]


@pytest.mark.parametrize("timeout", [float("nan"), "5", True], ids=["nan", "text", "bool"])
def test_a_timeout_that_is_no_number_is_bad_request_at_once(fake, timeout):
    server = fake(echo)
    with pytest.raises(BadRequest, match="timeout must be"):
        Client(server.endpoint, timeout=timeout)
    with Client(server.endpoint, timeout=BOUND_S) as client:
        with pytest.raises(BadRequest, match="timeout must be"):
            client.infer("m", "x", timeout=timeout)
        assert client.infer("m", "x", timeout=float("inf")) == "x"
    with pytest.raises(BadRequest, match="timeout must be"):
        control_call(server.endpoint, "ping", timeout_s=timeout)
    assert [h["text"] for h in server.seen] == ["x"]


@pytest.mark.parametrize("timeout", [0, -1])
def test_a_timeout_already_run_out_is_timeout(fake, timeout):
    server = fake(echo)
    with Client(server.endpoint, timeout=BOUND_S) as client:
        with pytest.raises(Timeout):
            client.infer("m", "x", timeout=timeout)


def test_a_bad_endpoint_is_bad_request_and_leaves_no_thread_behind():
    before = set(threading.enumerate())
    with pytest.raises(BadRequest, match="cannot connect to 'nonsense'"):
        Client("nonsense")
    with pytest.raises(BadRequest, match="CURVE keys are 40 Z85 characters"):
        Client("tcp://127.0.0.1:1", curve=CurveKeys(b"short", b"short", b"short"))
    with pytest.raises(DynbatchdError, match="cannot connect to") as raised:
        control_call("tcp://127.0.0.1:notaport", "ping")
    assert raised.value.code == "bad_request"
    assert set(threading.enumerate()) <= before


def test_control_call_names_an_answer_without_a_result(fake):
    server = fake(lambda h: [[frame({"ok": True})]])
    with pytest.raises(DynbatchdError, match="ok without a result"):
        control_call(server.endpoint, "ping", timeout_s=BOUND_S)


# --- Futures, threads, close ----------------------------------------------------------------------

def test_cancelling_a_future_withdraws_the_request_from_the_daemon(fake):
    server = fake(silent)
    with Client(server.endpoint, timeout=10 * BOUND_S) as client:   # the cancel is not the one its timeout sends
        future = client.submit("m", "x")
        wait_until(lambda: server.seen, BOUND_S, message="request never arrived")
        assert future.cancel()
        wait_until(lambda: {"id": 1, "cancel": True} in server.seen, BOUND_S, message="no cancel sent")
        wait_until(lambda: not client._async._pending, BOUND_S, message="request still pending")
        with pytest.raises(CancelledError):
            future.result(timeout=0)


def test_close_inside_a_done_callback_returns_and_closes_the_client(fake):
    server = fake(echo)
    client = Client(server.endpoint, timeout=BOUND_S)
    closed = threading.Event()
    future = client.submit("m", "x")
    future.add_done_callback(lambda _: (client.close(), closed.set()))
    assert closed.wait(BOUND_S), "close() in a done callback waited for ever on its own thread"
    wait_until(lambda: not client._thread.is_alive(), BOUND_S, message="client thread still running")
    assert future.result(timeout=0).output == "x"
    with pytest.raises(ClientClosed):
        client.infer("m", "y")


def test_waiting_inside_a_done_callback_raises_instead_of_waiting_for_ever(fake):
    server = fake(echo)
    outcome: list = []
    done = threading.Event()
    client = Client(server.endpoint, timeout=BOUND_S)   # no `with`: a client stuck on itself would not close

    def nested(_):
        try:
            outcome.append(client.infer("m", "inner"))
        except DynbatchdError as exc:
            outcome.append(exc)
        done.set()

    client.submit("m", "outer").add_done_callback(nested)
    assert done.wait(BOUND_S), "infer() in a done callback waited for ever"
    assert client.infer("m", "after") == "after"   # the client's thread is free again
    client.close()
    assert len(outcome) == 1 and isinstance(outcome[0], DynbatchdError) and "done callback" in str(outcome[0])


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_closed_clients_hold_no_file_descriptor_or_thread(fake):
    server = fake(echo)
    clients = []
    gc.collect()
    fds, threads = open_fds(), threading.active_count()
    for n in range(10):
        client = Client(server.endpoint, timeout=BOUND_S)
        assert client.infer("m", str(n)) == str(n)
        client.close()
        clients.append(client)   # kept: what a closed client holds is not left to the garbage collector
    assert open_fds() <= fds and threading.active_count() <= threads


def test_each_request_failed_by_close_gets_an_error_of_its_own(fake):
    """One ClientClosed shared by every caller gathered each raise's traceback on one object."""
    server = fake(silent)
    client = Client(server.endpoint, timeout=BOUND_S)
    futures = [client.submit("m", str(n)) for n in range(3)]
    wait_until(lambda: len(server.seen) == 3, BOUND_S, message="the requests did not reach the fake")
    client.close()
    errors = [f.exception(timeout=BOUND_S) for f in futures]
    assert all(isinstance(e, ClientClosed) for e in errors), errors
    assert len({id(e) for e in errors}) == 3


def test_close_racing_submits_and_streams_settles_every_caller(fake, capfd):
    server = fake(echo)
    client = Client(server.endpoint, timeout=BOUND_S)
    futures, ended, errors = [], [], []
    go = threading.Event()

    def submitter() -> None:
        go.wait(BOUND_S)
        for n in range(200):
            futures.append(client.submit("m", str(n)))

    def streamer() -> None:
        go.wait(BOUND_S)
        for n in range(50):
            try:
                list(client.stream("m", str(n)))
            except ClientClosed:
                pass
            except BaseException as exc:   # anything else is the fault this test is for
                errors.append(exc)
        ended.append(True)

    threads = [threading.Thread(target=f) for f in (submitter, submitter, streamer, streamer)]
    for t in threads:
        t.start()
    go.set()
    wait_until(lambda: len(futures) > 20, BOUND_S, interval_s=0.001, message="no request sent")
    client.close()
    for t in threads:
        t.join(BOUND_S)
    assert not any(t.is_alive() for t in threads), "a caller waits for ever after close()"
    done, not_done = wait(futures, timeout=BOUND_S)
    assert not not_done and not errors and len(ended) == 2
    assert {type(f.exception()) for f in done if f.exception()} <= {ClientClosed}
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("call", ["stream", "submit"])
def test_close_between_a_calls_check_and_its_start_settles_the_call(fake, monkeypatch, call):
    """close() run to its end just before the call hands its work to the client's thread (a thread
    switch there): the call must end ClientClosed, not wait for ever on a loop that stopped."""
    server = fake(echo)
    client = Client(server.endpoint, timeout=BOUND_S)
    real = asyncio.run_coroutine_threadsafe
    fired = []

    def close_first(coro, loop):
        if not fired:
            fired.append(True)
            closer = threading.Thread(target=client.close)
            closer.start()
            if not client._lock.locked():   # nothing holds close() back: it finishes first
                closer.join(BOUND_S)
        return real(coro, loop)

    monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", close_first)
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(list(client.stream("m", "x")) if call == "stream"
                           else client.submit("m", "x").result(timeout=BOUND_S))
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=run)
    caller.start()
    caller.join(BOUND_S)
    assert not caller.is_alive(), f"{call}() waits for ever after close()"
    wait_until(lambda: not client._thread.is_alive(), BOUND_S, message="client thread still running")
    assert len(outcome) == 1 and isinstance(outcome[0], (ClientClosed, Result, list)), outcome


# --- AsyncClient ----------------------------------------------------------------------------------

def test_an_async_client_serves_a_second_asyncio_run(fake):
    server = fake(echo)
    client = AsyncClient(server.endpoint, timeout=BOUND_S)

    async def three(tag: str) -> list:
        return await asyncio.gather(*(client.infer("m", f"{tag}{n}") for n in range(3)))

    try:
        assert asyncio.run(three("a")) == ["a0", "a1", "a2"]
        assert asyncio.run(three("b")) == ["b0", "b1", "b2"]   # not a Timeout: a reader runs on this loop
    finally:
        client.close()


def test_a_reader_whose_socket_failed_is_started_again_by_the_next_request(fake, monkeypatch):
    server = fake(echo)

    async def main() -> tuple:
        client = AsyncClient(server.endpoint, timeout=BOUND_S, context=zmq.asyncio.Context())
        real = client._sock.recv_multipart
        calls = []

        def fails_once(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise zmq.ZMQError(zmq.EFAULT, "socket failed")
            return real(*args, **kwargs)

        monkeypatch.setattr(client._sock, "recv_multipart", fails_once)
        try:
            with pytest.raises(DynbatchdError, match="socket failed"):
                await client.infer("m", "first")
            return await client.infer("m", "second")
        finally:
            client.close()
            client._ctx.destroy(linger=0)

    assert asyncio.run(asyncio.wait_for(main(), BOUND_S)) == "second"


def test_cancelling_async_calls_withdraws_them_and_leaves_nothing_pending(fake):
    server = fake(silent)

    async def main() -> AsyncClient:
        client = AsyncClient(server.endpoint, timeout=BOUND_S, context=zmq.asyncio.Context())
        call = asyncio.ensure_future(client.infer("m", "x"))
        stream = client.stream("m", "y")
        step = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.to_thread(wait_until, lambda: len(server.seen) == 2, BOUND_S), BOUND_S)
        call.cancel()
        step.cancel()
        for task in (call, step):
            with pytest.raises(asyncio.CancelledError):
                await task
        await stream.aclose()
        client.close()
        client._ctx.destroy(linger=0)
        return client

    client = asyncio.run(main())
    wait_until(lambda: sum(1 for h in server.seen if h.get("cancel")) == 2, BOUND_S, message="no cancels sent")
    assert client._pending == {} and client._streams == {}


# --- a real daemon going away under a client ------------------------------------------------------

def test_a_daemon_stopped_and_restarted_under_a_client(tmp_path):
    daemon = start_daemon(tmp_path, SIMULATED, cpu_threads=1)
    with Client(daemon.endpoint, timeout=BOUND_S) as client:
        assert client.infer("echo", "before") == "before"
        in_flight = [client.submit("sim", "x", deadline_ms=10_000) for _ in range(200)]
        daemon.stop()
        while_down = [client.submit("echo", f"down{n}") for n in range(3)]
        restarted = start_daemon(tmp_path, SIMULATED, cpu_threads=1)
        try:
            assert client.infer("echo", "after") == "after"
            assert sorted(f.result(timeout=BOUND_S).output for f in while_down) == ["down0", "down1", "down2"]
            done, not_done = wait(in_flight, timeout=BOUND_S)   # answered by the daemon that stopped, or the new one
        finally:
            restarted.stop()
    assert not not_done
    assert {type(f.exception()).__name__ for f in done if f.exception()} <= {"ShuttingDown"}
