"""The HTTP front door: OpenAI embeddings, KServe v2 inference, probes — in the daemon's process.

Configured by ``[http] listen = "127.0.0.1:8080"`` (off while empty). Starlette
routes on uvicorn, on the daemon's own event loop: a request becomes a
`dynbatchd.protocol.Request` and goes through the same routing, compliance,
cache and engine as one from the ZeroMQ socket (``LocalDoor.infer``), with no
proxy hop. Endpoints:

- ``POST /v1/embeddings`` (OpenAI): ``{"model", "input": str | [str], "user"?}``.
- ``POST /v2/models/{name}/infer`` (KServe v2): one BYTES input of texts
  (or FP32/INT64 data with a shape), or several named inputs for a model of
  several (a torchscript or exported program); outputs as v2 tensors.
- ``GET /v2/models/{name}``, ``/v2/models/{name}/ready``, ``/v2/health/live``,
  ``/v2/health/ready``; ``/healthz`` (the process answers) and ``/readyz``
  (serving: 503 while starting or draining) for load balancers and probes.

Headers: ``X-Deadline-Ms`` (the request's deadline), ``X-Tags`` (comma-separated
routing tags; else a body's ``"tags"`` or KServe ``parameters.tags`` list), ``X-Tenant``, ``X-Request-Type``, ``X-User-Frequency``. Every
error code maps to an HTTP status (`STATUS`); the body is ``{"error": {"code",
"message"}}``. Payloads are never logged: uvicorn's access log is off.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import numpy as np

from dynbatchd import protocol as P
from dynbatchd.hookspecs import hookimpl

log = logging.getLogger(__name__)

STATUS = {P.BAD_REQUEST: 400, P.REFUSED: 403, P.UNKNOWN_MODEL: 404, P.OVERLOADED: 429, P.CANCELLED: 499,
          P.MODEL_ERROR: 500, P.UNAVAILABLE: 503, P.SHUTTING_DOWN: 503, P.DEADLINE_EXCEEDED: 504}
V2_TYPES = {"float32": "FP32", "float64": "FP64", "float16": "FP16", "int64": "INT64", "int32": "INT32",
            "uint8": "UINT8", "bool": "BOOL"}
FROM_V2 = {v: k for k, v in V2_TYPES.items()}


class HttpError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def request_meta(headers: Any) -> dict[str, Any]:
    """The ZeroMQ request's metadata fields, from the HTTP headers."""
    meta: dict[str, Any] = {}
    if deadline := headers.get("x-deadline-ms"):
        try:
            meta["deadline_ms"] = float(deadline)
        except ValueError:
            raise HttpError(P.BAD_REQUEST, f"X-Deadline-Ms must be a number of milliseconds, not {deadline!r}")
        if not math.isfinite(meta["deadline_ms"]):
            raise HttpError(P.BAD_REQUEST, "X-Deadline-Ms must be finite")
    if tags := headers.get("x-tags"):
        meta["tags"] = [t.strip() for t in tags.split(",") if t.strip()]
    for header, field in (("x-tenant", "tenant"), ("x-request-type", "request_type"),
                          ("x-user-frequency", "user_frequency"), ("x-user", "user")):
        if value := headers.get(header):
            meta[field] = value
    return meta


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


class HttpDoor:
    def __init__(self, listen: str, api: Any):
        self.listen = listen   # the daemon names it if the door cannot start
        self.host, _, port = listen.rpartition(":")
        self.port = int(port)
        self.api = api
        self.server: Any = None
        self._task: Any = None

    # -- the app --------------------------------------------------------------
    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.routing import Route

        return Starlette(routes=[
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/v2/models/{name}/infer", self.v2_infer, methods=["POST"]),
            Route("/v2/models/{name}/ready", self.v2_model_ready, methods=["GET"]),
            Route("/v2/models/{name}", self.v2_model, methods=["GET"]),
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.ready, methods=["GET"]),
            Route("/healthz", self.live, methods=["GET"]),
            Route("/readyz", self.ready, methods=["GET"]),
        ])

    async def _infer_all(self, model: str, inputs: list[Any], meta: dict[str, Any]) -> list[Any]:
        """One request per input, all in flight at once (they batch together); their outputs in order."""
        import asyncio

        futures = [self.api.infer(P.Request(i + 1, model, **self._input_field(x), **meta))
                   for i, x in enumerate(inputs)]
        answers = await asyncio.gather(*futures)
        for answer in answers:
            if answer.code != "ok":
                raise HttpError(answer.code, answer.message)
        return [output_array(a) for a in answers]

    @staticmethod
    def _input_field(x: Any) -> dict[str, Any]:
        if isinstance(x, str):
            return {"text": x}
        return {"value": x}

    async def _body(self, request: Any) -> dict[str, Any]:
        """The JSON body, read only up to ``[daemon] max_request_bytes`` (as the ZeroMQ socket's bound)."""
        limit = self.api.max_request_bytes
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HttpError(P.BAD_REQUEST, f"the body exceeds max_request_bytes ({limit})")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except ValueError:
            raise HttpError(P.BAD_REQUEST, "the body is not JSON")
        if not isinstance(body, dict):
            raise HttpError(P.BAD_REQUEST, "the body must be a JSON object")
        return body

    def _error(self, exc: HttpError, *, v2: bool = False) -> Any:
        """The error body of the protocol asked: KServe v2 has ``{"error": string}`` (its clients read
        a string; ``code`` rides beside it), OpenAI ``{"error": {"code", "message"}}``."""
        from starlette.responses import JSONResponse

        headers = {"Retry-After": "1"} if exc.code in (P.OVERLOADED, P.SHUTTING_DOWN, P.UNAVAILABLE) else None
        body = ({"error": exc.message, "code": exc.code} if v2
                else {"error": {"code": exc.code, "message": exc.message}})
        return JSONResponse(body,
                            status_code=STATUS.get(exc.code, 500), headers=headers)

    async def embeddings(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            body = await self._body(request)
            model, inputs = body.get("model"), body.get("input")
            if not isinstance(model, str) or not model:
                raise HttpError(P.BAD_REQUEST, "\"model\" must name a model")
            texts = [inputs] if isinstance(inputs, str) else inputs
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise HttpError(P.BAD_REQUEST, "\"input\" must be a string or a non-empty list of strings")
            meta = request_meta(request.headers)
            if isinstance(body.get("user"), str):
                meta.setdefault("user", body["user"])
            body_tags(body.get("tags"), meta)
            outputs = await self._infer_all(model, texts, meta)
        except HttpError as exc:
            return self._error(exc)
        data = [{"object": "embedding", "index": i, "embedding": np.asarray(o, dtype=float).ravel().tolist()}
                for i, o in enumerate(outputs)]
        tokens = sum(P.estimate_tokens(P.Request(0, model, text=t)) for t in texts)
        return JSONResponse({"object": "list", "data": data, "model": model,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def v2_infer(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        name = request.path_params["name"]
        try:
            body = await self._body(request)
            items = self._v2_requests(body.get("inputs"))
            meta = request_meta(request.headers)
            params = body.get("parameters") or {}
            if isinstance(params, dict) and isinstance(params.get("deadline_ms"), (int, float)):
                meta.setdefault("deadline_ms", float(params["deadline_ms"]))
            if isinstance(params, dict):
                body_tags(params.get("tags"), meta)
            outputs = await self._infer_all(name, items, meta)
        except HttpError as exc:
            return self._error(exc, v2=True)
        stacked = np.stack([np.asarray(o) for o in outputs]) if outputs and not isinstance(outputs[0], str) else None
        if stacked is None:
            out = {"name": "output", "datatype": "BYTES", "shape": [len(outputs)], "data": list(outputs)}
        else:
            out = {"name": "output", "datatype": V2_TYPES.get(str(stacked.dtype), "FP32"),
                   "shape": list(stacked.shape), "data": stacked.ravel().tolist()}
        return JSONResponse({"model_name": name, "id": body.get("id", ""), "outputs": [out]})

    @classmethod
    def _v2_requests(cls, tensors: Any) -> list[Any]:
        """One input per request: the rows of the one tensor, or with several named tensors (a model
        of several inputs, such as an exported program) a table {name: row} per request."""
        if not isinstance(tensors, list) or not tensors or not all(isinstance(t, dict) for t in tensors):
            raise HttpError(P.BAD_REQUEST, "\"inputs\" must be a non-empty list of tensors")
        if len(tensors) == 1:
            return cls._v2_items(tensors[0])
        names = [t.get("name") for t in tensors]
        if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
            raise HttpError(P.BAD_REQUEST, "several inputs need a \"name\" each, all different")
        columns = [cls._v2_items(t) for t in tensors]
        if len({len(c) for c in columns}) != 1:
            raise HttpError(P.BAD_REQUEST, "every input must have the same first dimension (the batch)")
        return [dict(zip(names, row)) for row in zip(*columns)]

    @staticmethod
    def _v2_items(tensor: dict[str, Any]) -> list[Any]:
        """The per-request inputs of a v2 tensor: its first dimension is the batch."""
        datatype, shape, data = tensor.get("datatype"), tensor.get("shape"), tensor.get("data")
        if not isinstance(shape, list) or not shape or not isinstance(data, list):
            raise HttpError(P.BAD_REQUEST, "a v2 input needs \"shape\" (a list) and \"data\" (a list)")
        if datatype == "BYTES":
            if not all(isinstance(x, str) for x in data) or len(data) != shape[0]:
                raise HttpError(P.BAD_REQUEST, "BYTES data must be shape[0] strings")
            return list(data)
        if datatype not in FROM_V2:
            raise HttpError(P.BAD_REQUEST, f"datatype {datatype!r} is not supported")
        try:
            array = np.asarray(data, dtype=FROM_V2[datatype]).reshape(shape)
        except (ValueError, TypeError) as exc:
            raise HttpError(P.BAD_REQUEST, f"data does not fit shape {shape}: {exc}")
        return [row.tolist() for row in array]

    async def v2_model(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        name = request.path_params["name"]
        models = self.api.models
        if name not in models:
            return self._error(HttpError(P.UNKNOWN_MODEL, f"no model named {name!r}"), v2=True)
        if models[name].runner in ("torchscript", "exported"):   # the inputs its options declare
            declared = models[name].options.get("inputs") or [{"name": "input", "dtype": "float32"}]
            inputs = [{"name": i["name"], "datatype": V2_TYPES[i.get("dtype", "float32")],
                       "shape": [-1, *(i.get("shape") or [])]} for i in declared]
        else:
            inputs = [{"name": "input", "datatype": "BYTES", "shape": [-1]}]
        return JSONResponse({"name": name, "platform": f"dynbatchd/{models[name].runner}", "versions": ["1"],
                             "inputs": inputs,
                             "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, -1]}]})

    async def v2_model_ready(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        name = request.path_params["name"]
        if name not in self.api.models:
            return self._error(HttpError(P.UNKNOWN_MODEL, f"no model named {name!r}"), v2=True)
        ready = self.api.state == "serving"
        return JSONResponse({"name": name, "ready": ready}, status_code=200 if ready else 503)

    async def live(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse({"live": True, "state": self.api.state})

    async def ready(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        ready = self.api.state == "serving"
        return JSONResponse({"ready": ready, "state": self.api.state}, status_code=200 if ready else 503)

    # -- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        """Bind (an OSError names a port in use here, not a SystemExit inside uvicorn), then serve
        on the daemon's loop, leaving SIGTERM and SIGHUP to the daemon."""
        import asyncio
        import contextlib
        import socket

        import uvicorn

        host = self.host.strip("[]") or "127.0.0.1"
        sock = socket.create_server((host, self.port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        config = uvicorn.Config(self.app(), loop="none", lifespan="off", access_log=False, log_level="warning")
        self.server = uvicorn.Server(config)
        self.server.capture_signals = contextlib.nullcontext
        self._task = asyncio.ensure_future(self.server.serve(sockets=[sock]))
        while not self.server.started and not self._task.done():
            await asyncio.sleep(0.005)   # uvicorn says when its listener is up only through this flag
        if self._task.done():
            self._task.result()
        log.info("HTTP front door on http://%s:%d", host, self.port)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            if self._task is not None:
                await self._task


@hookimpl
def dynbatchd_front_doors() -> dict[str, Any]:
    def http(config: Any, api: Any) -> HttpDoor | None:
        return HttpDoor(config.http.listen, api) if config.http.listen else None
    return {"http": http}
