"""How the HTTP door answers over time: a streamed completion's server-sent events as they come,
and a generative request whose client hangs up first withdrawn (so its worker frees the KV room);
and how a connection opens (TLS accepted by hand, so that its handshake counts against
max_connections) and closes (within a bounded time, whether or not the client reads).
Mixins of `dynbatchd_plugins.http.HttpDoor` (`self.settings`: ``[http]``)."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import h11

from .httpgenerate import EventStream
from .httpwire import READ_SIZE, ClientGone, reason

log = logging.getLogger(__name__)
ACCEPT_PAUSE_S = 1.0   # after an accept failed (out of descriptors): as asyncio's own servers pause


class HttpStreaming:
    settings: Any
    _in_progress: int
    _write: Any   # HttpConnections._write

    async def _stream(self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      events: EventStream, headers: list) -> None:
        """Send a streamed completion's events as they come (chunked; the connection closes after it).
        (An error before the first token never gets here: the handler answers it with its own
        status, `HttpGenerate._generate`.) The client hanging up (its side read to the end) withdraws
        the request at once, so the worker frees its KV; each event must be taken within
        body_timeout_s, else the request is withdrawn too and the connection aborted (`_close`)."""
        self._in_progress += 1
        gone = asyncio.ensure_future(self._until_closed(reader))
        try:
            data = await self._next_event(events, gone)
            head = [("content-type", "text/event-stream"), ("cache-control", "no-cache"), *headers,
                    ("connection", "close")]
            self._write(writer, conn.send(h11.Response(status_code=200, headers=head, reason=reason(200))))
            while data is not None:
                self._write(writer, conn.send(h11.Data(data=data)))
                async with asyncio.timeout(self.settings.body_timeout_s):
                    await writer.drain()
                if (data := await self._next_event(events, gone)) is None:
                    self._write(writer, conn.send(h11.EndOfMessage()))
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


class HttpConnections:
    """A connection's life: counted from its accept (`_connections`: each one's task), its TLS
    handshake within header_timeout_s, closed within a bounded time once done."""
    settings: Any
    api: Any
    _connections: dict
    _refusing: bool
    _connection: Any   # HttpDoor._connection: a counted connection's requests

    @staticmethod
    def _write(writer: asyncio.StreamWriter, data: bytes) -> None:
        """Write, unless the client is gone: uvloop raises RuntimeError on a closed transport, so a
        client's reset was logged as a failure of the door (ERROR); it is a hang-up (ClientGone)."""
        if writer.transport.is_closing():
            raise ClientGone("before its answer was sent")
        writer.write(data)

    @staticmethod
    def _forget_failure(reader: asyncio.StreamReader) -> None:
        """Drop the traceback of the error a connection ended on, as its reader keeps it: each read or
        drain that raised it added frames that hold the reader, a cycle that kept its buffers, h11
        state and, over TLS, the SSL objects until a full collection (rare in the daemon)."""
        if (failure := reader.exception()) is not None:
            failure.__traceback__ = None

    def _admit(self) -> bool:
        """Whether one more connection fits max_connections (the caller then counts it). The first
        refusal of a run of them is logged, one line; the next once one was admitted again."""
        if len(self._connections) < self.settings.max_connections:
            self._refusing = False
            return True
        if not self._refusing:
            log.warning("HTTP door: max_connections (%d) open: further connections refused until one closes",
                        self.settings.max_connections)
        self._refusing = True
        return False

    async def _close(self, writer: asyncio.StreamWriter, delivered: bool) -> None:
        """Close a connection: gracefully where its answer was all written, yet within body_timeout_s;
        else, or then, abort. A transport's close first sends what it still holds, which a client
        that reads nothing never takes: the socket, a descriptor the daemon needs, stayed forever."""
        if delivered:
            writer.close()
            try:
                async with asyncio.timeout(self.settings.body_timeout_s):
                    await writer.wait_closed()
                return
            except (Exception, asyncio.CancelledError):   # timed out, reset, or stop(): ends now
                pass
        writer.transport.abort()

    async def _listen_tls(self, listener: socket.socket, context: Any) -> None:
        """Accept TLS connections by hand: each counts against max_connections from its accept, and
        one beyond is closed at once, with no handshake. (asyncio's TLS server shakes hands before
        its callback can count, so clients that send no ClientHello held a descriptor each for
        header_timeout_s, uncounted; and a transport accepted plain, then upgraded, loses the
        ClientHello under uvloop, which reads before its protocol can pause it.)"""
        loop, failing = asyncio.get_running_loop(), False
        try:
            while True:
                try:
                    sock, _ = await loop.sock_accept(listener)
                except OSError as exc:   # out of descriptors (EMFILE), or reset before it was taken
                    if not failing:      # (one line a run of them)
                        log.warning("HTTP door: connections cannot be accepted (%s)", exc.strerror or exc)
                    failing = True
                    await asyncio.sleep(ACCEPT_PAUSE_S)
                    continue
                failing = False
                if not self._admit():
                    sock.close()
                    continue
                task = loop.create_task(self._serve_tls(sock, context))
                self._connections[task] = False
                task.add_done_callback(lambda done, sock=sock: done.cancelled() and sock.close())  # (never ran)
        finally:
            listener.close()

    async def _serve_tls(self, sock: socket.socket, context: Any) -> None:
        """One counted TLS connection: its handshake within header_timeout_s, then its requests."""
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        reader = asyncio.StreamReader()
        protocol = asyncio.StreamReaderProtocol(reader)
        try:
            transport, _ = await loop.connect_accepted_socket(
                lambda: protocol, sock, ssl=context, ssl_handshake_timeout=self.settings.header_timeout_s)
        except (Exception, asyncio.CancelledError) as exc:   # no handshake in time, not TLS, gone, stop()
            log.debug("HTTP door: a TLS handshake failed (%s): closed", type(exc).__name__)
            sock.close()
            self._connections.pop(task, None)
            return
        await self._connection(reader, asyncio.StreamWriter(transport, protocol, reader, loop))

    def _tls_context(self) -> Any:
        """With ``tls_cert`` and ``tls_key``: a server context (TLS 1.2 at least), else None."""
        if not self.settings.tls_cert:
            return None
        import ssl

        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.settings.tls_cert, self.settings.tls_key)
        return context

    async def _linger(self, conn: h11.Connection, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        """Before closing on a request it did not read to the end, drop what the client still sends (up to
        header_timeout_s and 4 x max_request_bytes): a client that sends its whole body before
        reading then reads the answer, not a reset. It stops once the body has all come: TLS cannot
        half-close, so a client reading to the close would otherwise wait header_timeout_s, and hold
        a connection, after every request refused before its body (401, 403, 413...)."""
        budget = 4 * self.api.max_request_bytes
        if writer.can_write_eof():   # (TLS cannot half-close)
            writer.write_eof()
        try:
            async with asyncio.timeout(self.settings.header_timeout_s):
                while budget > 0 and not self._body_ended(conn) and (data := await reader.read(READ_SIZE)):
                    budget -= len(data)
                    if conn.their_state is h11.SEND_BODY:   # else dropped unparsed: no buffer grows
                        conn.receive_data(data)
        except (TimeoutError, ConnectionError):
            pass

    @staticmethod
    def _body_ended(conn: h11.Connection) -> bool:
        """Whether the client's request, body included, has all come (what is left of it is dropped);
        False while its end is unknown: no head (IDLE) or a malformed body (ERROR) are read to the close."""
        try:
            while conn.their_state is h11.SEND_BODY and (event := conn.next_event()) is not h11.NEED_DATA:
                if isinstance(event, h11.ConnectionClosed):
                    return True
        except h11.RemoteProtocolError:
            return False
        return conn.their_state in (h11.DONE, h11.MUST_CLOSE)   # (MUST_CLOSE: ended, on a connection closing)
