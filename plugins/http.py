"""The HTTP front door: OpenAI embeddings, KServe v2 inference, probes — in the daemon's process.

Configured by ``[http] listen = "127.0.0.1:8080"`` (off while empty). A small HTTP/1.1
server of its own (h11 on asyncio streams, on the daemon's event loop): a request
becomes one `dynbatchd.protocol.Request` per input and goes through the same routing,
compliance, cache and engine as one from the ZeroMQ socket (``LocalDoor.infer``), with
no proxy hop. Endpoints:

- ``POST /v1/embeddings`` (OpenAI): ``{"model", "input": str | [str], "user"?}``.
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
a head's size and lines, and the time a head, a body or a reply may take; a request's
inputs are admitted all or none, submitted a chunk per loop turn. Payloads are never
logged: a fault is logged in one line naming the route and the reason.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import h11
import msgspec
import numpy as np

from dynbatchd import protocol as P
from dynbatchd.hookspecs import hookimpl
from dynbatchd.httpkeys import KeyStore, presented_key
from dynbatchd.logs import MAX_ID, request_fields, safe_id

log = logging.getLogger(__name__)

STATUS = {P.BAD_REQUEST: 400, P.REFUSED: 403, P.UNKNOWN_MODEL: 404, P.OVERLOADED: 429, P.QUOTA_EXCEEDED: 429,
          P.CANCELLED: 499, P.MODEL_ERROR: 500, P.UNAVAILABLE: 503, P.SHUTTING_DOWN: 503, P.DEADLINE_EXCEEDED: 504}
RETRY_LATER = (P.OVERLOADED, P.SHUTTING_DOWN, P.UNAVAILABLE, P.QUOTA_EXCEEDED)
V2_TYPES = {"float32": "FP32", "float64": "FP64", "float16": "FP16", "int64": "INT64", "int32": "INT32",
            "uint8": "UINT8", "bool": "BOOL"}
FROM_V2 = {v: k for k, v in V2_TYPES.items()}
UNAUTHORIZED = "unauthorized"   # no key, a wrong or a revoked one: 401, and nothing more is said
OPEN_HANDLERS = ("live", "ready")   # probes answer without a key (load balancers have none)
SUBMIT_CHUNK = 64     # inputs submitted per loop turn: a large request never holds the ZeroMQ door up
READ_SIZE = 65536
# (method, path segments with None for the model's name, handler): the whole routing table
ROUTES = [("POST", ("v1", "embeddings"), "embeddings"),
          ("POST", ("v2", "models", None, "infer"), "v2_infer"),
          ("GET", ("v2", "models", None, "ready"), "v2_model_ready"),
          ("GET", ("v2", "models", None), "v2_model"),
          ("GET", ("v2", "health", "live"), "live"),
          ("GET", ("v2", "health", "ready"), "ready"),
          ("GET", ("healthz",), "live"),
          ("GET", ("readyz",), "ready")]


class HttpError(Exception):
    """An answer other than 200: the error code, a message that carries no payload, the status."""

    def __init__(self, code: str, message: str, status: int | None = None):
        super().__init__(message)
        self.code, self.message = code, message
        self.status = status or STATUS.get(code, 500)
        self.retry_after = "1"   # Retry-After (seconds) of a code in RETRY_LATER
        self.extra: list[tuple[str, str]] = []   # more headers (WWW-Authenticate)
        self.level = logging.DEBUG   # of its log line; a model's fault (bad_output) is a warning


class ClientGone(Exception):
    """The client closed its connection before its request was complete: nothing to answer."""
    request_id = "-"


def request_id(headers: dict[str, str]) -> str:
    """The request's id: its ``X-Request-Id`` (printable ASCII kept, cut to MAX_ID characters), else a
    new one. Echoed in the reply's X-Request-Id; the id of the daemon's request for input i is
    ``ID`` for a request of one input, else ``ID#i``: in the audit log and every log line about it."""
    given = safe_id(headers.get("x-request-id", ""), MAX_ID)
    return given.strip() or uuid.uuid4().hex


def request_meta(headers: dict[str, str]) -> dict[str, Any]:
    """The ZeroMQ request's metadata fields, from the HTTP headers."""
    meta: dict[str, Any] = {}
    if deadline := headers.get("x-deadline-ms"):
        try:
            meta["deadline_ms"] = float(deadline)
        except ValueError:
            raise HttpError(P.BAD_REQUEST, "X-Deadline-Ms must be a number of milliseconds")
        if not math.isfinite(meta["deadline_ms"]):
            raise HttpError(P.BAD_REQUEST, "X-Deadline-Ms must be finite")
    if tags := headers.get("x-tags"):
        meta["tags"] = [t.strip() for t in tags.split(",") if t.strip()]
    for header, field in (("x-tenant", "tenant"), ("x-request-type", "request_type"),
                          ("x-user-frequency", "user_frequency"), ("x-user", "user")):
        if value := headers.get(header):
            meta[field] = value
    if rid := headers.get(":request-id"):   # set by the door (request_id), as ":authenticated" is
        meta["_request_id"] = rid
    if headers.get(":authenticated"):   # set by the door from an API key, never by a client (no ":" in names)
        meta["_caller"] = (meta.get("tenant"), tuple(c for c in headers[":channels"].split(",") if c))
    return meta


def text_headers(raw: Any) -> dict[str, str]:
    """The first value of each header, as text. A value that is not UTF-8 is refused, as the ZeroMQ
    door refuses such a string: headers become request fields (tenant, user, tags)."""
    headers: dict[str, str] = {}
    for name, value in raw:
        try:
            headers.setdefault(name.decode("ascii"), value.decode("utf-8"))
        except UnicodeDecodeError:
            raise HttpError(P.BAD_REQUEST, f"header {name.decode('latin-1')} is not UTF-8")
    return headers


def body_tags(tags: Any, meta: dict[str, Any]) -> None:
    """Tags from the body (OpenAI ``"tags"``, KServe ``parameters.tags``), where no X-Tags header gave them."""
    if tags is None or "tags" in meta:
        return
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise HttpError(P.BAD_REQUEST, "\"tags\" must be a list of strings")
    meta["tags"] = tags


def output_array(answer: Any) -> np.ndarray | Any:
    """A successful answer's output: a numpy array for a tensor, else the plain value."""
    value, data = answer.output
    if data is None:
        return value
    return np.frombuffer(data, dtype=value.dtype).reshape(value.shape)


def bad_output(model: str, what: str) -> HttpError:
    """A model's answer that HTTP cannot carry: 502, the model's fault, logged as a warning (its name,
    never its output) with the request's id."""
    error = HttpError(P.MODEL_ERROR, f"model {model!r} answered {what}", 502)
    error.level = logging.WARNING
    return error


def reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:   # 499
        return ""


class HttpDoor:
    def __init__(self, settings: Any, api: Any):
        self.settings = settings   # [http]
        self.listen = settings.listen   # the daemon names it if the door cannot start
        self.host, _, port = settings.listen.rpartition(":")
        self.port = int(port)
        self.api = api
        self.keys = KeyStore(api.keys_dir) if settings.keys else None
        self.unauthorized = 0   # requests answered 401
        self._server: asyncio.AbstractServer | None = None
        self._connections: dict[asyncio.Task, bool] = {}   # each connection's task: busy with a request?
        self._in_progress = 0
        self._closing = False

    # -- one connection ------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection's requests, one after another (keep-alive); closed at the first that
        leaves it unusable, or when idle for header_timeout_s."""
        task = asyncio.current_task()
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.settings.max_header_bytes)
        peer = "%s:%s" % (writer.get_extra_info("peername") or ("?", "?"))[:2]
        try:
            if len(self._connections) >= self.settings.max_connections:
                error = HttpError(P.OVERLOADED, f"the HTTP door has max_connections "
                                                f"({self.settings.max_connections}) open")
                writer.write(self._reply_bytes(conn, *self._error(error, False), close=True))
                return
            self._connections[task] = False
            while not self._closing:
                self._connections[task] = False
                reply = await self._exchange(conn, reader, writer, task, peer)
                if reply is None:
                    break
                close = self._closing or conn.their_state is not h11.DONE
                writer.write(self._reply_bytes(conn, *reply, close=close))
                async with asyncio.timeout(self.settings.body_timeout_s):
                    await writer.drain()
                if conn.their_state in (h11.IDLE, h11.SEND_BODY, h11.ERROR):   # answered before the end
                    await self._linger(reader, writer)
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    break
                conn.start_next_cycle()
        except ClientGone as gone:
            log.info("HTTP client %s closed its connection mid-request %s (%s)", peer, gone.request_id, gone,
                     extra=request_fields(gone.request_id))
        except (ConnectionError, TimeoutError):
            log.info("HTTP client %s did not take its answer: connection closed", peer)
        except Exception as exc:   # a bug costs this connection, never the daemon's log a traceback with payload
            log.error("HTTP connection from %s failed: %s", peer, type(exc).__name__)
        finally:
            self._connections.pop(task, None)
            writer.close()

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Before closing on a request it did not read to the end, drop what the client still sends (up to
        header_timeout_s and 4 x max_request_bytes): a client that sends its whole body before
        reading then reads the answer, not a reset."""
        budget = 4 * self.api.max_request_bytes
        if writer.can_write_eof():   # (TLS cannot half-close)
            writer.write_eof()
        try:
            async with asyncio.timeout(self.settings.header_timeout_s):
                while budget > 0 and (data := await reader.read(READ_SIZE)):
                    budget -= len(data)
        except (TimeoutError, ConnectionError):
            pass

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
            if self._in_progress >= self.settings.max_requests:
                raise HttpError(P.OVERLOADED, f"the HTTP door has max_requests ({self.settings.max_requests}) "
                                              "in progress")
            self._in_progress += 1
            try:
                body = await self._body(conn, reader, writer, headers, peer)
                status, answer = await handler(name, headers, body)
            finally:
                self._in_progress -= 1
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
            log.error("HTTP %s request %s: internal error (%s); answered 500", route, rid, type(exc).__name__,
                      extra=request_fields(rid, code=P.MODEL_ERROR))
            status, body, extra = self._error(HttpError(P.MODEL_ERROR, "internal error in the daemon; see its log",
                                                        500), v2)
            return status, body, [*extra, ("x-request-id", rid)]

    async def _head(self, conn: h11.Connection, reader: asyncio.StreamReader, peer: str) -> h11.Request | None:
        """The next request's head, within header_timeout_s and the size and line limits."""
        limits = self.settings
        try:
            async with asyncio.timeout(limits.header_timeout_s):
                event = await self._event(conn, reader)
        except TimeoutError:
            if conn.their_state is h11.IDLE and not conn.trailing_data[0]:
                return None   # idle between requests: closed quietly
            log.info("HTTP client %s sent no complete request head in %gs: answered 408", peer,
                     limits.header_timeout_s)
            raise HttpError(P.BAD_REQUEST, f"no complete request head in {limits.header_timeout_s:g}s", 408)
        except h11.RemoteProtocolError as exc:
            if exc.error_status_hint == 431:
                log.info("HTTP client %s sent a head over max_header_bytes: answered 431", peer)
                raise HttpError(P.BAD_REQUEST, f"the head exceeds max_header_bytes ({limits.max_header_bytes})", 431)
            log.info("HTTP client %s sent a malformed request: answered 400", peer)
            raise HttpError(P.BAD_REQUEST, "malformed HTTP request")
        if isinstance(event, h11.ConnectionClosed):
            return None
        size = len(event.target) + sum(len(n) + len(v) + 4 for n, v in event.headers)
        if len(event.headers) > limits.max_headers or size > limits.max_header_bytes:
            log.info("HTTP client %s sent %d header lines, %d bytes: answered 431", peer, len(event.headers), size)
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
        if int(headers.get("content-length") or 0) > limit:
            raise HttpError(P.BAD_REQUEST, f"the body exceeds max_request_bytes ({limit})", 413)
        if conn.they_are_waiting_for_100_continue:
            writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
        chunks, size = [], 0
        try:
            async with asyncio.timeout(timeout):
                while isinstance(event := await self._event(conn, reader), h11.Data):
                    size += len(event.data)
                    if size > limit:
                        raise HttpError(P.BAD_REQUEST, f"the body exceeds max_request_bytes ({limit})", 413)
                    chunks.append(event.data)
        except TimeoutError:
            log.info("HTTP client %s sent %d bytes of the body of request %s in %gs: answered 408", peer, size,
                     headers[":request-id"], timeout, extra=request_fields(headers[":request-id"]))
            raise HttpError(P.BAD_REQUEST, f"the body did not arrive in {timeout:g}s", 408)
        except h11.RemoteProtocolError:
            if reader.at_eof():
                raise ClientGone(f"{size} bytes of its body sent")
            log.info("HTTP client %s sent a malformed body for request %s: answered 400", peer,
                     headers[":request-id"], extra=request_fields(headers[":request-id"]))
            raise HttpError(P.BAD_REQUEST, "malformed HTTP body")
        if isinstance(event, h11.ConnectionClosed):
            raise ClientGone(f"{size} bytes of its body sent")
        return b"".join(chunks)

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

    # -- inference -------------------------------------------------------------
    @staticmethod
    def _json(raw: bytes) -> dict[str, Any]:
        """The body as a JSON object. msgspec refuses what the ZeroMQ door would: invalid UTF-8, a lone
        surrogate (``"\\ud800"``), NaN; and nesting deeper than the interpreter's recursion limit."""
        try:
            body = msgspec.json.decode(raw)
        except (msgspec.DecodeError, RecursionError):
            raise HttpError(P.BAD_REQUEST, "the body is not JSON in UTF-8 (lone surrogates, NaN and "
                                           "very deep nesting are refused)")
        if not isinstance(body, dict):
            raise HttpError(P.BAD_REQUEST, "the body must be a JSON object")
        return body

    def _check_count(self, n: int) -> None:
        if n > self.settings.max_inputs:
            raise HttpError(P.BAD_REQUEST, f"{n} inputs exceed [http] max_inputs ({self.settings.max_inputs})", 413)

    async def _infer_all(self, model: str, inputs: list[Any], meta: dict[str, Any]) -> list[Any]:
        """One request per input, all in flight at once (they batch together); their outputs in order.
        All or none: the first input refused or failed answers the whole HTTP request, and those still
        queued are withdrawn (none is dispatched before the loop turns, so a refusal in the first chunk
        runs none). SUBMIT_CHUNK inputs per loop turn, so the ZeroMQ door is never starved."""
        futures: list[Any] = []
        tenant, channels = meta.pop("_caller", (None, ()))
        rid = meta.pop("_request_id", None) or uuid.uuid4().hex
        try:
            for i, x in enumerate(inputs):
                if i and not i % SUBMIT_CHUNK:
                    await asyncio.sleep(0)
                future = self.api.infer(P.Request(rid if len(inputs) == 1 else f"{rid}#{i}", model,
                                                  **self._input_field(x), **meta),
                                        tenant=tenant, channels=channels)
                futures.append(future)
                if future.done():   # refused at once (overloaded, refused, ...): withdraw the others now
                    self._check(future.result())
            return [output_array(self._check(await future)) for future in futures]
        except HttpError as exc:
            if exc.code == P.QUOTA_EXCEEDED:   # when its tenant's bucket holds a request again
                exc.retry_after = self.api.retry_after(meta.get("tenant"))
            raise
        finally:
            for future in futures:
                if not future.done():
                    self.api.withdraw(future)

    @staticmethod
    def _check(answer: Any) -> Any:
        if answer.code != "ok":
            raise HttpError(answer.code, answer.message)
        return answer

    @staticmethod
    def _input_field(x: Any) -> dict[str, Any]:
        if isinstance(x, str):
            return {"text": x}
        return {"value": x}

    async def embeddings(self, _: None, headers: dict[str, str], raw: bytes) -> tuple[int, Any]:
        body = self._json(raw)
        model, inputs = body.get("model"), body.get("input")
        if not isinstance(model, str) or not model:
            raise HttpError(P.BAD_REQUEST, "\"model\" must name a model")
        texts = [inputs] if isinstance(inputs, str) else inputs
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise HttpError(P.BAD_REQUEST, "\"input\" must be a string or a non-empty list of strings")
        self._check_count(len(texts))
        meta = request_meta(headers)
        if isinstance(body.get("user"), str):
            meta.setdefault("user", body["user"])
        body_tags(body.get("tags"), meta)
        outputs = await self._infer_all(model, texts, meta)
        try:
            vectors = [np.asarray(o, dtype=np.float64).ravel() for o in outputs]
        except (ValueError, TypeError):
            raise bad_output(model, "outputs that are not numbers")
        if not all(np.isfinite(v).all() for v in vectors):
            raise bad_output(model, "numbers that are not finite (NaN or infinity)")
        data = [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)]
        tokens = sum(P.estimate_tokens(P.Request(0, model, text=t)) for t in texts)
        return 200, {"object": "list", "data": data, "model": model,
                     "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def v2_infer(self, name: str, headers: dict[str, str], raw: bytes) -> tuple[int, Any]:
        body = self._json(raw)
        if not isinstance(body.get("id", ""), str):
            raise HttpError(P.BAD_REQUEST, "\"id\" must be a string")
        items = self._v2_requests(body.get("inputs"))
        meta = request_meta(headers)
        params = body.get("parameters") or {}
        if isinstance(params, dict) and isinstance(params.get("deadline_ms"), (int, float)):
            meta.setdefault("deadline_ms", float(params["deadline_ms"]))
        if isinstance(params, dict):
            body_tags(params.get("tags"), meta)
        outputs = await self._infer_all(name, items, meta)
        return 200, {"model_name": name, "id": body.get("id", ""), "outputs": [self._v2_output(name, outputs)]}

    @staticmethod
    def _v2_output(model: str, outputs: list[Any]) -> dict[str, Any]:
        """The outputs as one v2 tensor: BYTES for texts, else stacked numbers (502 if they cannot be)."""
        if all(isinstance(o, str) for o in outputs):
            return {"name": "output", "datatype": "BYTES", "shape": [len(outputs)], "data": list(outputs)}
        try:
            stacked = np.stack([np.asarray(o) for o in outputs])
        except ValueError:
            raise bad_output(model, "outputs of different shapes")
        datatype = V2_TYPES.get(str(stacked.dtype))
        if datatype is None:
            raise bad_output(model, f"outputs of type {stacked.dtype.kind!r}, not numbers")
        if stacked.dtype.kind == "f" and not np.isfinite(stacked).all():
            raise bad_output(model, "numbers that are not finite (NaN or infinity)")
        return {"name": "output", "datatype": datatype, "shape": list(stacked.shape), "data": stacked.ravel().tolist()}

    def _v2_requests(self, tensors: Any) -> list[Any]:
        """One input per request: the rows of the one tensor, or with several named tensors (a model
        of several inputs, such as an exported program) a table {name: row} per request."""
        if not isinstance(tensors, list) or not tensors or not all(isinstance(t, dict) for t in tensors):
            raise HttpError(P.BAD_REQUEST, "\"inputs\" must be a non-empty list of tensors")
        if len(tensors) == 1:
            return self._v2_items(tensors[0])
        names = [t.get("name") for t in tensors]
        if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
            raise HttpError(P.BAD_REQUEST, "several inputs need a \"name\" each, all different")
        columns = [self._v2_items(t) for t in tensors]
        if len({len(c) for c in columns}) != 1:
            raise HttpError(P.BAD_REQUEST, "every input must have the same first dimension (the batch)")
        return [dict(zip(names, row)) for row in zip(*columns)]

    def _v2_items(self, tensor: dict[str, Any]) -> list[Any]:
        """The per-request inputs of a v2 tensor: its first dimension is the batch."""
        datatype, shape, data = tensor.get("datatype"), tensor.get("shape"), tensor.get("data")
        if (not isinstance(shape, list) or not shape or not isinstance(data, list)
                or not all(type(d) is int and d >= 0 for d in shape)):
            raise HttpError(P.BAD_REQUEST, "a v2 input needs \"shape\" (a list of dimensions >= 0) and "
                                           "\"data\" (a list)")
        self._check_count(shape[0])
        if datatype == "BYTES":
            if not all(isinstance(x, str) for x in data) or len(data) != shape[0]:
                raise HttpError(P.BAD_REQUEST, "BYTES data must be shape[0] strings")
            return list(data)
        if datatype not in FROM_V2:
            raise HttpError(P.BAD_REQUEST, f"datatype {str(datatype)[:16]!r} is not supported")
        try:
            array = np.asarray(data, dtype=FROM_V2[datatype]).reshape(shape)
        except (ValueError, TypeError, OverflowError):
            raise HttpError(P.BAD_REQUEST, f"data does not fit shape {shape} of {datatype}")
        return [row.tolist() for row in array]

    # -- metadata and probes ---------------------------------------------------
    async def v2_model(self, name: str, headers: dict[str, str], raw: bytes) -> tuple[int, Any]:
        models = self.api.models
        if name not in models:
            raise HttpError(P.UNKNOWN_MODEL, f"no model named {name!r}")
        if models[name].runner in ("torchscript", "exported"):   # the inputs its options declare
            declared = models[name].options.get("inputs") or [{"name": "input", "dtype": "float32"}]
            inputs = [{"name": i["name"], "datatype": V2_TYPES[i.get("dtype", "float32")],
                       "shape": [-1, *(i.get("shape") or [])]} for i in declared]
        else:
            inputs = [{"name": "input", "datatype": "BYTES", "shape": [-1]}]
        return 200, {"name": name, "platform": f"dynbatchd/{models[name].runner}", "versions": ["1"],
                     "inputs": inputs, "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, -1]}]}

    async def v2_model_ready(self, name: str, headers: dict[str, str], raw: bytes) -> tuple[int, Any]:
        if name not in self.api.models:
            raise HttpError(P.UNKNOWN_MODEL, f"no model named {name!r}")
        ready = self.api.state == "serving"
        return (200 if ready else 503), {"name": name, "ready": ready}

    async def live(self, *_: Any) -> tuple[int, Any]:
        return 200, {"live": True, "state": self.api.state}

    async def ready(self, *_: Any) -> tuple[int, Any]:
        ready = self.api.state == "serving"
        return (200 if ready else 503), {"ready": ready, "state": self.api.state}

    # -- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        """Bind (an OSError names a port in use), then serve on the daemon's loop."""
        import socket

        host = self.host.strip("[]") or "127.0.0.1"
        tls = self._tls_context()
        sock = socket.create_server((host, self.port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._server = await asyncio.start_server(self._serve, sock=sock, ssl=tls,
                                                  ssl_handshake_timeout=self.settings.header_timeout_s if tls else None)
        log.info("HTTP front door on %s://%s:%d%s", "https" if tls else "http", host, self.port,
                 " (API keys required)" if self.keys is not None else "")

    def _tls_context(self) -> Any:
        """With ``tls_cert`` and ``tls_key``: a server context (TLS 1.2 at least), else None."""
        if not self.settings.tls_cert:
            return None
        import ssl

        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.settings.tls_cert, self.settings.tls_key)
        return context

    async def stop(self) -> None:
        """Stop listening and close idle connections; a request in progress (the daemon drained, so
        its answer is at hand) gets up to body_timeout_s to be answered."""
        self._closing = True
        if self._server is not None:
            self._server.close()
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
        return HttpDoor(config.http, api) if config.http.listen else None
    return {"http": http}
