"""What the HTTP door's server and its endpoints share: the status of each error code, the
routing table, `HttpError`, and the pure helpers that read headers and shape outputs.

Split out of `dynbatchd_plugins.http` (which re-exports these names) so the h11 server and the
endpoint handlers are modules of their own. Nothing here logs.
"""


from __future__ import annotations

import logging
import math
import uuid
from http import HTTPStatus
from typing import Any

import numpy as np

from dynbatchd import protocol as P
from dynbatchd.errors import DynbatchdError
from dynbatchd.logs import MAX_ID, safe_id

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
          ("POST", ("v1", "completions"), "completions"),
          ("POST", ("v1", "chat", "completions"), "chat_completions"),
          ("POST", ("v2", "models", None, "infer"), "v2_infer"),
          ("GET", ("v2", "models", None, "ready"), "v2_model_ready"),
          ("GET", ("v2", "models", None), "v2_model"),
          ("GET", ("v2", "health", "live"), "live"),
          ("GET", ("v2", "health", "ready"), "ready"),
          ("GET", ("healthz",), "live"),
          ("GET", ("readyz",), "ready")]


class HttpError(DynbatchdError):
    """An answer other than 200: the error code, a message that carries no payload, the status."""

    def __init__(self, code: str, message: str, status: int | None = None):
        super().__init__(message)
        self.code, self.message = code, message
        self.status = status or STATUS.get(code, 500)
        self.retry_after = "1"   # Retry-After (seconds) of a code in RETRY_LATER
        self.extra: list[tuple[str, str]] = []   # more headers (WWW-Authenticate)
        self.level = logging.DEBUG   # of its log line; a model's fault (bad_output) is a warning


class ClientGone(DynbatchdError):
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
