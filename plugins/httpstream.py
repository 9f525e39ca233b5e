"""How the HTTP door answers over time: a streamed completion's server-sent events as they come,
and a generative request whose client hangs up first withdrawn (so its worker frees the KV room).
A mixin of `dynbatchd_plugins.http.HttpDoor` (`self.settings`: ``[http]``)."""

from __future__ import annotations

import asyncio
from typing import Any

import h11

from .httpgenerate import EventStream
from .httpwire import READ_SIZE, ClientGone, reason


class HttpStreaming:
    settings: Any
    _in_progress: int

    async def _stream(self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      events: EventStream, headers: list) -> None:
        """Send a streamed completion's events as they come (chunked; the connection closes after it).
        (An error before the first token never gets here: the handler answers it with its own
        status, `HttpGenerate._generate`.) The client hanging up (its side read to the end) withdraws the request at once, so the worker
        frees its KV; each event must be taken within body_timeout_s."""
        self._in_progress += 1
        gone = asyncio.ensure_future(self._until_closed(reader))
        try:
            data = await self._next_event(events, gone)
            head = [("content-type", "text/event-stream"), ("cache-control", "no-cache"), *headers,
                    ("connection", "close")]
            writer.write(conn.send(h11.Response(status_code=200, headers=head, reason=reason(200))))
            while data is not None:
                writer.write(conn.send(h11.Data(data=data)))
                async with asyncio.timeout(self.settings.body_timeout_s):
                    await writer.drain()
                if (data := await self._next_event(events, gone)) is None:
                    writer.write(conn.send(h11.EndOfMessage()))
            async with asyncio.timeout(self.settings.body_timeout_s):
                await writer.drain()
        except ClientGone as exc:
            exc.request_id = dict(headers).get("x-request-id", "-")
            raise
        finally:
            gone.cancel()
            events.close()
            self._in_progress -= 1

    @staticmethod
    async def _next_event(events: EventStream, gone: asyncio.Future) -> bytes | None:
        """The stream's next event (None after the last), unless the client hangs up first."""
        following = asyncio.ensure_future(events.__anext__())
        await asyncio.wait((following, gone), return_when=asyncio.FIRST_COMPLETED)
        if not following.done():
            following.cancel()
            raise ClientGone("mid-stream: withdrawn")
        try:
            return following.result()
        except StopAsyncIteration:
            return None

    @staticmethod
    async def _unless_gone(answering: Any, conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
        """Await `answering` (a handler); the client closing its connection first cancels it, which
        withdraws its request.

        The watch is a read (asyncio streams have no peek), so it may take bytes: a pipelined next
        request's. It hands them to h11, which keeps them for the connection's next request (h11's
        buffer is where `_head` looks first); after that the watch is over, and a hang-up shows when
        the answer is written. Before returning, the watch is cancelled and awaited: a reader allows
        one read at a time, and the next request's read failed (an unrequested 500) while a cancelled
        watch still waited. A read cancelled before it completes takes no bytes: they stay in the reader."""
        task = asyncio.ensure_future(answering)
        watch = asyncio.ensure_future(reader.read(READ_SIZE))
        try:
            await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
            if watch.done() and not task.done() and not _taken(watch):
                task.cancel()
                await asyncio.wait((task,))
                raise ClientGone("while its answer was made: withdrawn")
            return await task
        finally:
            task.cancel()
            watch.cancel()
            await asyncio.wait((watch,))   # (not `await watch`: that would raise its CancelledError)
            if (data := _taken(watch)) is not None:
                conn.receive_data(data)

    @staticmethod
    async def _until_closed(reader: asyncio.StreamReader) -> None:
        """Returns when the client closes its side (what it sends meanwhile is dropped)."""
        try:
            while await reader.read(READ_SIZE):
                pass
        except ConnectionError:
            pass


def _taken(watch: asyncio.Future) -> bytes | None:
    """What a finished hang-up watch read (b"": the client closed, or reset), or None: it was cancelled."""
    if watch.cancelled():
        return None
    return b"" if watch.exception() is not None else watch.result()
