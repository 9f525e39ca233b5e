"""Clients for dynbatchd: `AsyncClient` (asyncio) and `Client` (blocking, thread-safe).

Both keep many requests in flight on one DEALER socket and match replies by
id. Errors arrive as exceptions, one class per protocol error code, all
subclasses of `DynbatchdError` with a `.code`.

Every request has a timeout, 60 s (`DEFAULT_TIMEOUT_S`) unless the client or
the call sets another; `None` (no limit) only when asked for explicitly. A
request that runs out raises `Timeout`, which is also a `TimeoutError`, and
closing a client fails whatever it still has in flight with `ClientClosed`,
so no caller waits forever on a daemon that went away. An answer the client
cannot read fails its request with `BadReply`; cancelling a `Client.submit`
Future withdraws the request. Done callbacks run on the client's own thread:
waiting on the client there raises instead of waiting for ever.

A daemon with ``[daemon] curve`` on takes CURVE clients only on its tcp://
addresses: give each client its key pair and the daemon's public key,
``curve=CurveKeys.load("client.key_secret", "server.key")`` (files from
``dynbatchctl keygen``). A client whose key the daemon does not admit gets no
answer at all (a `Timeout`; `control_call` says "refused" as soon as the
handshake fails). The keys are used on tcp:// endpoints only: ipc:// relies on
file permissions.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Any, Iterator

import zmq.asyncio

from dynbatchd.asyncclient import AsyncClient
from dynbatchd.clientwire import (CLIENT_TIMEOUT, DEFAULT_STREAM_BUFFER_BYTES, DEFAULT_TIMEOUT_S,  # noqa: F401
                                  ERRORS, BadReply, BadRequest,
                                  Cancelled, ClientClosed, CurveKeys, DeadlineExceeded, DynbatchdError, ModelError,
                                  NotRunning, Overloaded, QuotaExceeded, Refused, Result, ShuttingDown,
                                  StreamOverflow, Timeout, Unavailable, UnknownModel, build_request, check_running,
                                  not_listening, parse_reply, raise_for, timeout_seconds)
from dynbatchd.controlcall import control_call  # noqa: F401  (public API)
from dynbatchd.protocol import Chunk

_END = object()
# Items a stream hands to the caller's thread ahead of it; the rest wait in the stream's own bounded buffer.
HANDOFF = 64


class Client:
    """Blocking client; thread-safe, with many requests in flight (`submit` returns a Future).

    `timeout` (seconds, default ``DEFAULT_TIMEOUT_S`` = 60) bounds every
    request unless a call gives its own (``timeout=None`` only when asked:
    no limit). Past it the request raises `Timeout` (a `TimeoutError`).
    `close()` resolves every Future still pending with `ClientClosed`, and a
    `submit` after close returns a Future already failed that way. `curve`: as
    for `AsyncClient`, and so is `stream_buffer_bytes`.
    """

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5555", *, timeout: float | None = DEFAULT_TIMEOUT_S,
                 curve: CurveKeys | None = None, stream_buffer_bytes: int = DEFAULT_STREAM_BUFFER_BYTES):
        self.endpoint = endpoint
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dynbatchd-client", daemon=True)
        self._thread.start()
        self._futures: set[Future] = set()
        self._lock = threading.Lock()
        self._closed = False
        try:
            options = dict(timeout=timeout, curve=curve, stream_buffer_bytes=stream_buffer_bytes)
            self._async = self._call(self._make(endpoint, options))
        except BaseException:   # a bad endpoint, key or timeout: no thread or loop left running behind
            self._stop_loop()
            raise

    async def _make(self, endpoint: str, options: dict[str, Any]) -> AsyncClient:
        context = zmq.asyncio.Context()
        try:
            return AsyncClient(endpoint, context=context, **options)
        except BaseException:
            context.destroy(linger=0)
            raise

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        """Stop the client's thread and close its loop (the loop holds three file descriptors)."""
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    def _refuse_on_own_thread(self, what: str) -> None:
        """Waiting for the client on its own thread (a Future's done callback runs there) would wait
        for ever: say so instead."""
        if threading.current_thread() is self._thread:
            raise DynbatchdError(f"cannot {what} inside a done callback of this client's Futures: it would wait "
                                 "for ever on itself (use submit() and a callback, or another thread)", "bad_request")

    def submit(self, model: str, inputs: Any, **kwargs: Any) -> Future:
        """Start a request; the Future's result is a `Result` (output plus timing). Cancelling the
        Future withdraws the request from the daemon too."""
        fut: Future = Future()
        with self._lock:   # scheduled before close() may stop the loop: it then settles the request
            if self._closed:
                fut.set_exception(ClientClosed("client closed"))
                return fut
            self._futures.add(fut)
            inner = asyncio.run_coroutine_threadsafe(self._async.infer_result(model, inputs, **kwargs), self._loop)
        fut.add_done_callback(self._forget)
        fut.add_done_callback(lambda f: f.cancelled() and self._withdraw(inner))
        inner.add_done_callback(lambda done: self._settle(fut, done))
        return fut

    def _withdraw(self, inner: Future) -> None:
        """The caller cancelled its Future: cancel the request's task, whose cleanup tells the daemon."""
        if not self._loop.is_closed():   # closed: the client is, and nothing is left to withdraw
            inner.cancel()

    def _forget(self, fut: Future) -> None:
        with self._lock:
            self._futures.discard(fut)

    @staticmethod
    def _settle(fut: Future, done: Future) -> None:
        """Copy the loop's outcome onto the caller's Future, unless close() settled it first."""
        if fut.done():
            return
        try:
            if done.cancelled():
                fut.set_exception(ClientClosed("client closed"))
            elif done.exception() is not None:
                fut.set_exception(done.exception())
            else:
                fut.set_result(done.result())
        except InvalidStateError:   # settled by close() in between
            pass

    def infer_result(self, model: str, inputs: Any, **kwargs: Any) -> Result:
        self._refuse_on_own_thread("wait for a request")
        return self.submit(model, inputs, **kwargs).result()

    def infer(self, model: str, inputs: Any, **kwargs: Any) -> Any:
        """Send one input and block for its output; raises a `DynbatchdError` subclass on error."""
        return self.infer_result(model, inputs, **kwargs).output

    def stream(self, model: str, text: str, **kwargs: Any) -> Iterator[Chunk | Result]:
        """A generative model's answer as it is generated: each `dynbatchd.protocol.Chunk`, then one
        `Result` (`AsyncClient.stream`, whose keyword arguments it takes). Leaving the loop early
        cancels the request."""
        self._refuse_on_own_thread("stream")
        items: queue.SimpleQueue = queue.SimpleQueue()
        ended = threading.Event()
        room = asyncio.Semaphore(HANDOFF)   # a slow caller leaves chunks in the stream's buffer, which is bounded

        async def pump() -> None:
            try:
                async for item in self._async.stream(model, text, **kwargs):
                    await room.acquire()
                    items.put(item)
            except BaseException as exc:   # (a cancel from the caller leaving included: nobody reads it then)
                items.put(exc)
            finally:
                items.put(_END)
                ended.set()

        with self._lock:   # scheduled before close() may stop the loop, which then ends the pump
            if self._closed:
                raise ClientClosed("client closed")
            running = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := items.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                try:
                    self._loop.call_soon_threadsafe(room.release)
                except RuntimeError:   # the loop is closed (the client too): nothing is pumping any more
                    pass
                yield item
        finally:
            if not ended.is_set():
                running.cancel()   # the stream's own cleanup sends the daemon a cancel ...
                ended.wait(5)      # ... before this returns, so a close() right after cannot drop it

    def close(self) -> None:
        """Stop the client; every request still pending fails with `ClientClosed`. Called in a done
        callback of one of its Futures (on the client's own thread), it returns at once and the
        client closes as soon as the callback is over."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if threading.current_thread() is self._thread:
            threading.Thread(target=self._shut_down, name="dynbatchd-client-close", daemon=True).start()
        else:
            self._shut_down()

    def _shut_down(self) -> None:
        async def _close() -> None:
            self._async.close()   # every request in flight fails with ClientClosed ...
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if tasks:   # ... and its task ends here, its outcome retrieved: no "Task was destroyed" on stderr
                _, stuck = await asyncio.wait(tasks, timeout=5)
                for task in stuck:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            self._async._ctx.destroy(linger=0)

        try:
            self._call(_close())
        finally:
            self._stop_loop()
            with self._lock:
                left = list(self._futures)
            for fut in left:   # whatever the loop did not settle before it stopped
                if not fut.done():
                    try:
                        fut.set_exception(ClientClosed("client closed"))
                    except InvalidStateError:
                        pass

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
