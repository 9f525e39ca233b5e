"""The HTTP door's endpoints: OpenAI embeddings, KServe v2 inference and model metadata, the
probes. Each takes (model name or None, headers, raw body) and returns (status, JSON body) or
raises `HttpError`; the server (`dynbatchd_plugins.http.HttpDoor`) finds them by name from ROUTES.

A request's inputs become one `dynbatchd.protocol.Request` each, submitted through the daemon's
`LocalDoor` (`self.api`), all or none, a chunk per loop turn.
"""


from __future__ import annotations

import asyncio
import uuid
from typing import Any, Iterator

import msgspec
import numpy as np

from dynbatchd import protocol as P
from dynbatchd.config import MAX_MS

from .httpwire import FROM_V2, SUBMIT_CHUNK, V2_TYPES, HttpError, bad_output, body_tags, output_array, request_meta

# What a numeric v2 datatype's values must be in JSON, by numpy kind: (their Python types, in words)
V2_VALUES = {"b": ((bool,), "true or false"),
             "i": ((int,), "integers (not strings, bools or fractions)"),
             "u": ((int,), "integers (not strings, bools or fractions)"),
             "f": ((int, float), "numbers (not strings or bools)")}


class HttpEndpoints:
    """The handlers of ROUTES, as methods of the door: they read `self.api` (the daemon's LocalDoor)
    and `self.settings` (``[http]``), which `HttpDoor.__init__` sets."""

    api: Any
    settings: Any

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
            for future in futures:   # (a cancelled handler's await cancelled its future: withdraw that too)
                if not future.done() or future.cancelled():
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
        params = body.get("parameters", {})
        if not isinstance(params, dict):
            raise HttpError(P.BAD_REQUEST, "\"parameters\" must be an object")
        if params.get("deadline_ms") is not None:   # (null: none, as over ZeroMQ); checked where X-Deadline-Ms wins too
            meta.setdefault("deadline_ms", self._v2_deadline(params["deadline_ms"]))
        body_tags(params.get("tags"), meta)
        outputs = await self._infer_all(name, items, meta)
        return 200, {"model_name": name, "id": body.get("id", ""), "outputs": [self._v2_output(name, outputs)]}

    @staticmethod
    def _v2_deadline(value: Any) -> float:
        """``parameters.deadline_ms`` held to the ZeroMQ door's rule (`dynbatchd.transport.validate`: > 0,
        at most MAX_MS), but checked here so the answer names the body's key, and before float(): JSON
        carries what msgpack cannot, ``true`` (Python's 1) and integers too large for a float."""
        rule = f"parameters.deadline_ms must be a number > 0 and <= {MAX_MS:.0f} (one day)"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise HttpError(P.BAD_REQUEST, f"{rule}, not {type(value).__name__}")
        if not 0 < value <= MAX_MS:   # (compares a huge int exactly: no float() to overflow)
            raise HttpError(P.BAD_REQUEST, rule)
        return float(value)

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
        return [row.tolist() for row in self._v2_array(tensor, datatype, shape, data)]

    @staticmethod
    def _v2_array(tensor: dict[str, Any], datatype: str, shape: list[int], data: list[Any]) -> np.ndarray:
        """A numeric v2 tensor as the array its datatype declares. numpy would take a string ("1e400"),
        a bool as 1, a float as an integer (truncated) and a value its type cannot hold (FP16 beyond
        65504) as infinity: the model would then get what the client never meant, and be blamed
        (502). Each is the client's fault: 400, naming the input and the rule."""
        where = f"input {str(tensor.get('name', ''))[:64]!r}"
        dtype = np.dtype(FROM_V2[datatype])
        kinds, what = V2_VALUES[dtype.kind]
        if not all(type(x) in kinds for x in _leaves(data)):
            raise HttpError(P.BAD_REQUEST, f"{where}: {datatype} data must be {what}")
        try:
            with np.errstate(over="ignore", invalid="ignore"):   # overflow is checked below, not warned
                array = np.asarray(data, dtype=dtype)
        except OverflowError:
            raise HttpError(P.BAD_REQUEST, f"{where}: a value is out of the range of {datatype}")
        except (ValueError, TypeError):
            raise HttpError(P.BAD_REQUEST, f"{where}: data does not fit shape {shape} of {datatype}")
        if dtype.kind == "f" and not np.isfinite(array).all():
            raise HttpError(P.BAD_REQUEST, f"{where}: a value is out of the range of {datatype} "
                                           "(finite numbers only)")
        try:
            return array.reshape(shape)
        except (ValueError, TypeError, OverflowError):
            raise HttpError(P.BAD_REQUEST, f"{where}: data does not fit shape {shape} of {datatype}")

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


def _leaves(data: list[Any]) -> Iterator[Any]:
    """The values of nested JSON lists, without recursion (the nesting is the client's)."""
    stack = [data]
    while stack:
        for x in stack.pop():
            if type(x) is list:
                stack.append(x)
            else:
                yield x
