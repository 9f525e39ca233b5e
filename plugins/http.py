"""The HTTP front door: OpenAI embeddings, KServe v2 inference, probes — in the daemon's process.

Configured by ``[http] listen = "127.0.0.1:8080"`` (off while empty), a table this plugin owns
(`dynbatchd_plugins.http_config`: its shape and rules). A small HTTP/1.1
server of its own (h11 on asyncio streams, on the daemon's event loop): a request
becomes one `dynbatchd.protocol.Request` per input and goes through the same routing,
compliance, cache and engine as one from the ZeroMQ socket (``LocalDoor.infer``), with
no proxy hop. Endpoints:

- ``POST /v1/embeddings`` (OpenAI): ``{"model", "input": str | [str], "user"?}``.
- ``POST /v1/completions`` and ``POST /v1/chat/completions`` (OpenAI) for a causal-lm model,
  whole or, with ``"stream": true``, as server-sent events (`httpgenerate`).
- ``POST /v2/models/{name}/infer`` (KServe v2): one BYTES input of texts
  (or FP32/INT64 data with a shape), or several named inputs for a model of
  several (a torchscript or exported program); outputs as v2 tensors.
- ``GET /v2/models/{name}``, ``/v2/models/{name}/ready``, ``/v2/health/live``,
  ``/v2/health/ready``; ``/healthz`` (the process answers) and ``/readyz``
  (serving: 503 while starting or draining) for load balancers and probes.

Headers: ``X-Deadline-Ms`` (the request's deadline), ``X-Tags`` (comma-separated
routing tags; else a body's ``"tags"`` or KServe ``parameters.tags`` list), ``X-Tenant``,
``X-Request-Type``, ``X-User-Frequency``, ``X-User``, ``X-Request-Id`` (the request's id, else
one is made; every reply carries it back, and the audit log and the log lines about the request
name it: see `request_id`). Every error code maps to an HTTP status (`STATUS`); the body is
``{"error": {"code", "message"}}``.

Nothing a client sends can wedge it (issue 23): every string must be UTF-8, as over ZeroMQ;
the ``[http]`` limits bound a request's inputs, the requests and connections in progress,
a head's size and lines, and the time a head, a body or a reply may take (a connection counts
from its accept, its TLS handshake included, until its socket is closed); a request's
inputs are admitted all or none, submitted a chunk per loop turn. Payloads are never
logged: a fault is logged in one line naming the route and the reason.

The server and request handling is here; the endpoint handlers are in `httpendpoints` (and the
generative ones in `httpgenerate`), the server-sent events, the hang-up watch and how a connection
opens and closes in `httpstream`, the shared table and helpers in `httpwire` (whose names this
module re-exports).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any
from urllib.parse import unquote

import h11
import msgspec

from dynbatchd import protocol as P
from dynbatchd.hookspecs import hookimpl
from dynbatchd.httpkeys import KeyStore, presented_key
from dynbatchd.logs import LineBudget, request_fields

from .http_config import dynbatchd_config_tables, http_settings  # noqa: F401  (registers [http])
from .httpendpoints import HttpEndpoints
from .httpgenerate import GENERATIVE, EventStream, HttpGenerate
from .httpstream import HttpConnections, HttpStreaming
from .httpwire import (FROM_V2, OPEN_HANDLERS, READ_SIZE, RETRY_LATER, ROUTES, STATUS, SUBMIT_CHUNK,  # noqa: F401
                       UNAUTHORIZED, V2_TYPES, ClientGone, HttpError, bad_output, body_tags, output_array,
                       reason, request_id, request_meta, text_headers)

log = logging.getLogger(__name__)
UNCOUNTED = ("live", "ready", "v2_model", "v2_model_ready")   # handlers that run no model: no max_requests slot


class HttpDoor(HttpEndpoints, HttpGenerate, HttpStreaming, HttpConnections):
    """The door: an h11 server on the daemon's loop, its connections, limits, keys and lifecycle."""

    def __init__(self, settings: Any, api: Any):
        self.settings = settings   # [http]
        self.listen = settings.listen   # the daemon names it if the door cannot start
        self.host, _, port = settings.listen.rpartition(":")
        self.port = int(port)
        self.api = api
        self.keys = KeyStore(api.keys_dir) if settings.keys else None
        self.unauthorized = 0   # requests answered 401
        self._server: asyncio.AbstractServer | None = None   # plain; TLS is accepted by _accepting
        self._accepting: asyncio.Task | None = None
        self._connections: dict[asyncio.Task, bool] = {}   # each connection's task: busy with a request?
        self._in_progress = 0
        self._body_bytes = 0   # of the bodies being read, all connections: at most max_body_bytes
        self._closing = False
        self._refusing = False   # refusing connections beyond max_connections (logged once a run)
        self._lines = LineBudget()   # lines about one client's request: a flood of them is counted (`_note`)

    # -- one connection ------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A plain connection, from its accept: counted against max_connections, else answered 429 and
        closed (`_listen_tls` counts a TLS one)."""
        if not self._admit():
            error = HttpError(P.OVERLOADED, f"the HTTP door has max_connections ({self.settings.max_connections}) open")
            if not writer.transport.is_closing():   # (uvloop raises on writing to a closed one)
                writer.write(self._reply_bytes(h11.Connection(h11.SERVER), *self._error(error, False), close=True))
            await self._close(writer, not writer.transport.get_write_buffer_size())
            return
        self._connections[asyncio.current_task()] = False
        await self._connection(reader, writer)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One counted connection's requests, one after another (keep-alive); closed at the first that
        leaves it unusable, or when idle for header_timeout_s; aborted where an answer could not be
        sent (`_close`). It leaves `_connections` once closed."""
        task = asyncio.current_task()
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.settings.max_header_bytes)
        peer = "%s:%s" % (writer.get_extra_info("peername") or ("?", "?"))[:2]
        delivered = False
        try:
            while not self._closing:
                self._connections[task] = False
                reply = await self._exchange(conn, reader, writer, task, peer)
                if reply is None:
                    break
                if isinstance(reply[1], EventStream):
                    await self._stream(conn, reader, writer, reply[1], reply[2])
                    break
                close = self._closing or conn.their_state is not h11.DONE
                self._write(writer, self._reply_bytes(conn, *reply, close=close))
                async with asyncio.timeout(self.settings.body_timeout_s):
                    await writer.drain()
                if conn.their_state in (h11.IDLE, h11.SEND_BODY, h11.ERROR):   # answered before the end
                    await self._linger(conn, reader, writer)
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    break
                conn.start_next_cycle()
            delivered = True
        except ClientGone as gone:
            self._note("gone", "HTTP client %s closed its connection mid-request %s (%s)", peer, gone.request_id, gone,
                       extra=request_fields(gone.request_id))
        except (ConnectionError, TimeoutError):
            self._note("untaken", "HTTP client %s did not take its answer: connection closed", peer)
        except asyncio.CancelledError:   # stop() ends it: ended quietly, for asyncio (3.11) logs a traceback
            pass                         # at ERROR for each cancelled connection task
        except Exception as exc:   # a bug costs this connection, never the daemon's log a traceback with payload
            self._note("failed", "HTTP connection from %s failed: %s", peer, type(exc).__name__, level=logging.ERROR)
        finally:
            await self._close(writer, delivered)
            self._connections.pop(task, None)
            self._forget_failure(reader)

    def _note(self, kind: str, message: str, *args: Any, level: int = logging.INFO, **kwargs: Any) -> None:
        """A line about one client or request, within its `kind`'s `LineBudget`: a flood of bad
        requests or hang-ups is counted into the next line written, not written a line each."""
        if log.isEnabledFor(level) and (more := self._lines.admit(kind)) is not None:
            log.log(level, message + "%s", *args, more, **kwargs)

    async def _event(self, conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
        while (event := conn.next_event()) is h11.NEED_DATA:
            try:
                data = await reader.read(READ_SIZE)
            except ConnectionError:
                data = b""
            conn.receive_data(data)
        return event

    async def _exchange(self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        task: asyncio.Task, peer: str) -> tuple[int, bytes, list] | None:
        """Read one request and answer it: (status, body, headers), or None when the connection
        ends without a request (closed, or idle past header_timeout_s)."""
        v2, route, rid = False, "-", uuid.uuid4().hex   # rid: the id until X-Request-Id is read
        try:
            request = await self._head(conn, reader, peer)
            if request is None:
                return None
            self._connections[task] = True
            handler, route, name = self._route(request.method.decode("ascii"), request.target)
            v2 = route.startswith("/v2/")
            headers = text_headers(request.headers)
            headers[":request-id"] = rid = request_id(headers)
            if self.keys is not None and handler.__name__ not in OPEN_HANDLERS:
                self._authenticate(headers)
            body = await self._body(conn, reader, writer, headers, peer)
            status, answer = await self._run(handler, name, headers, body, conn, reader)
            if isinstance(answer, EventStream):
                return status, answer, [("x-request-id", rid)]
            try:
                return status, msgspec.json.encode(answer), [("x-request-id", rid)]
            except (msgspec.EncodeError, ValueError, TypeError, OverflowError):
                raise bad_output(name or route, "an answer JSON cannot carry")
        except HttpError as exc:
            log.log(exc.level, "HTTP %s request %s: %d %s%s", route, rid, exc.status, exc.code,
                    f" ({exc.message})" if exc.level > logging.DEBUG else "",
                    extra=request_fields(rid, code=exc.code))
            status, body, extra = self._error(exc, v2)
            return status, body, [*extra, ("x-request-id", rid)]
        except ClientGone as gone:
            gone.request_id = rid
            raise
        except Exception as exc:   # a bug: one line, no traceback (an exception's text may quote a payload)
            self._note("500", "HTTP %s request %s: internal error (%s); answered 500", route, rid, type(exc).__name__,
                       extra=request_fields(rid, code=P.MODEL_ERROR), level=logging.ERROR)
            status, body, extra = self._error(HttpError(P.MODEL_ERROR, "internal error in the daemon; see its log",
                                                        500), v2)
            return status, body, [*extra, ("x-request-id", rid)]

    async def _run(self, handler: Any, name: str | None, headers: dict[str, str], body: bytes,
                   conn: h11.Connection, reader: asyncio.StreamReader) -> tuple[int, Any]:
        """Run a handler whose body has been read. An inference takes one of max_requests slots only
        now: a client trickling its body in holds a connection (max_connections, body_timeout_s), not
        a slot, so slow bodies cannot fill the door. Probes and metadata (UNCOUNTED) take none: they
        cost nothing, and an orchestrator that sees /readyz refused restarts a daemon that serves."""
        if handler.__name__ in UNCOUNTED:
            return await handler(name, headers, body)
        if self._in_progress >= self.settings.max_requests:
            raise HttpError(P.OVERLOADED, f"the HTTP door has max_requests ({self.settings.max_requests}) in progress")
        self._in_progress += 1
        try:
            if handler.__name__ in GENERATIVE:   # long: a client that hangs up withdraws it
                return await self._unless_gone(handler(name, headers, body), conn, reader)
            return await handler(name, headers, body)
        finally:
            self._in_progress -= 1

    async def _head(self, conn: h11.Connection, reader: asyncio.StreamReader, peer: str) -> h11.Request | None:
        """The next request's head, within header_timeout_s and the size and line limits."""
        limits = self.settings
        try:
            async with asyncio.timeout(limits.header_timeout_s):
                event = await self._event(conn, reader)
        except TimeoutError:
            if conn.their_state is h11.IDLE and not conn.trailing_data[0]:
                return None   # idle between requests: closed quietly
            self._note("408", "HTTP client %s sent no complete request head in %gs: answered 408", peer,
                       limits.header_timeout_s)
            raise HttpError(P.BAD_REQUEST, f"no complete request head in {limits.header_timeout_s:g}s", 408)
        except h11.RemoteProtocolError as exc:
            if exc.error_status_hint == 431:
                self._note("431", "HTTP client %s sent a head over max_header_bytes: answered 431", peer)
                raise HttpError(P.BAD_REQUEST, f"the head exceeds max_header_bytes ({limits.max_header_bytes})", 431)
            self._note("400", "HTTP client %s sent a malformed request: answered 400", peer)
            raise HttpError(P.BAD_REQUEST, "malformed HTTP request")
        if isinstance(event, h11.ConnectionClosed):
            return None
        size = len(event.target) + sum(len(n) + len(v) + 4 for n, v in event.headers)
        if len(event.headers) > limits.max_headers or size > limits.max_header_bytes:
            self._note("431", "HTTP client %s sent %d header lines, %d bytes: answered 431", peer, len(event.headers), size)
            raise HttpError(P.BAD_REQUEST, f"the head exceeds max_headers ({limits.max_headers}) or "
                                           f"max_header_bytes ({limits.max_header_bytes})", 431)
        return event

    def _authenticate(self, headers: dict[str, str]) -> None:
        """The caller's key must be one of ``KEYS_DIR/http``: else 401, whatever was wrong. Its tenant
        becomes the request's (a different X-Tenant is refused), its channels bound where it goes."""
        caller = self.keys.check(presented_key(headers))
        if caller is None:
            self.unauthorized += 1
            error = HttpError(UNAUTHORIZED, "unauthorized", 401)
            error.extra = [("www-authenticate", "Bearer")]
            raise error
        if headers.get("x-tenant", caller.tenant) != caller.tenant:
            raise HttpError(P.REFUSED, "X-Tenant names a tenant other than the API key's")
        headers["x-tenant"] = caller.tenant
        headers[":channels"] = ",".join(caller.channels)
        headers[":authenticated"] = "1"

    def _route(self, method: str, target: bytes) -> tuple[Any, str, str | None]:
        """(handler, route pattern, the model named in the path); 404 or 405 for no route."""
        try:
            parts = [unquote(p, errors="strict") for p in target.partition(b"?")[0].decode("ascii").split("/")[1:]]
        except UnicodeDecodeError:
            raise HttpError(P.BAD_REQUEST, "the path is not UTF-8")
        allowed = False
        for verb, pattern, handler in ROUTES:
            if len(pattern) == len(parts) and all(p == q or (p is None and q) for p, q in zip(pattern, parts)):
                if verb == method:
                    name = next((q for p, q in zip(pattern, parts) if p is None), None)
                    route = "/" + "/".join(p or "{name}" for p in pattern)
                    return getattr(self, handler), route, name
                allowed = True
        if allowed:
            raise HttpError(P.BAD_REQUEST, f"method {method} is not allowed here", 405)
        raise HttpError(P.BAD_REQUEST, "no such endpoint", 404)

    async def _body(self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    headers: dict[str, str], peer: str) -> bytes:
        """The body, within ``[daemon] max_request_bytes`` (the ZeroMQ socket's bound; 413 beyond,
        before reading it when Content-Length says so) and body_timeout_s (408)."""
        limit, timeout = self.api.max_request_bytes, self.settings.body_timeout_s
        declared = int(headers.get("content-length") or 0)
        if declared > limit:
            raise HttpError(P.BAD_REQUEST, f"the body exceeds max_request_bytes ({limit})", 413)
        held = self._hold_body_bytes(0, declared)   # before the 100 Continue: a client told to wait sends nothing
        if conn.they_are_waiting_for_100_continue:
            self._write(writer, conn.send(h11.InformationalResponse(status_code=100, headers=[])))
        chunks, size = [], 0
        try:
            async with asyncio.timeout(timeout):
                while isinstance(event := await self._event(conn, reader), h11.Data):
                    size += len(event.data)
                    if size > limit:
                        raise HttpError(P.BAD_REQUEST, f"the body exceeds max_request_bytes ({limit})", 413)
                    held = self._hold_body_bytes(held, size)
                    chunks.append(event.data)
        except TimeoutError:
            self._note("408", "HTTP client %s sent %d bytes of the body of request %s in %gs: answered 408", peer, size,
                       headers[":request-id"], timeout, extra=request_fields(headers[":request-id"]))
            raise HttpError(P.BAD_REQUEST, f"the body did not arrive in {timeout:g}s", 408)
        except h11.RemoteProtocolError:
            if reader.at_eof() or reader.exception() is not None:   # closed, or reset
                raise ClientGone(f"{size} bytes of its body sent")
            self._note("400", "HTTP client %s sent a malformed body for request %s: answered 400", peer,
                       headers[":request-id"], extra=request_fields(headers[":request-id"]))
            raise HttpError(P.BAD_REQUEST, "malformed HTTP body")
        finally:
            self._body_bytes -= held
        if isinstance(event, h11.ConnectionClosed):
            raise ClientGone(f"{size} bytes of its body sent")
        return b"".join(chunks)

    def _hold_body_bytes(self, held: int, size: int) -> int:
        """Count a body of `size` bytes (its Content-Length, or what has come of it) against the door's
        max_body_bytes for all bodies being read, where `held` were counted; 429 beyond. A budget of
        less than one max_request_bytes body still admits one, alone."""
        more = max(size - held, 0)
        budget = max(self.settings.max_body_bytes, self.api.max_request_bytes)
        if more and self._body_bytes + more > budget:
            raise HttpError(P.OVERLOADED, f"the HTTP door is reading max_body_bytes ({budget}) of request "
                                          "bodies at once")
        self._body_bytes += more
        return held + more

    @staticmethod
    def _reply_bytes(conn: h11.Connection, status: int, body: bytes, headers: list, *, close: bool) -> bytes:
        head = [("content-type", "application/json"), ("content-length", str(len(body))), *headers]
        if close:
            head.append(("connection", "close"))
        try:
            return b"".join((conn.send(h11.Response(status_code=status, headers=head, reason=reason(status))),
                             conn.send(h11.Data(data=body)), conn.send(h11.EndOfMessage())))
        except h11.LocalProtocolError:   # no request to answer in h11's view (its head never came): by hand
            lines = [f"HTTP/1.1 {status} {reason(status)}", *(f"{k}: {v}" for k, v in head), "", ""]
            return "\r\n".join(lines).encode("latin-1") + body

    @staticmethod
    def _error(exc: HttpError, v2: bool) -> tuple[int, bytes, list]:
        """The error body of the protocol asked: KServe v2 has ``{"error": string}`` (its clients read
        a string; ``code`` rides beside it), OpenAI ``{"error": {"code", "message"}}``."""
        headers = ([("retry-after", exc.retry_after)] if exc.code in RETRY_LATER else []) + exc.extra
        body = ({"error": exc.message, "code": exc.code} if v2
                else {"error": {"code": exc.code, "message": exc.message}})
        return exc.status, msgspec.json.encode(body), headers

    # -- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        """Bind (an OSError names a port in use), then serve on the daemon's loop: plain by asyncio's
        server, TLS by an accept loop of the door's own that counts each handshake (`_listen_tls`)."""
        import socket

        host = self.host.strip("[]") or "127.0.0.1"
        tls = self._tls_context()
        sock = socket.create_server((host, self.port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        if tls is None:
            self._server = await asyncio.start_server(self._serve, sock=sock)
        else:
            sock.setblocking(False)
            self._accepting = asyncio.ensure_future(self._listen_tls(sock, tls))
        log.info("HTTP front door on %s://%s:%d%s", "https" if tls else "http", host, self.port,
                 " (API keys required)" if self.keys is not None else "")

    async def stop(self) -> None:
        """Stop listening and close idle connections; a request in progress (the daemon drained, so
        its answer is at hand) gets up to body_timeout_s to be answered."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.wait((self._accepting,))
        for task, busy in list(self._connections.items()):
            if not busy:
                task.cancel()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=self.settings.body_timeout_s)
        for task in list(self._connections):
            task.cancel()


@hookimpl
def dynbatchd_front_doors() -> dict[str, Any]:
    def http(config: Any, api: Any) -> HttpDoor | None:
        settings = http_settings(config)
        return HttpDoor(settings, api) if settings.listen else None
    return {"http": http}
