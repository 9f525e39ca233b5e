"""The HTTP door's generative endpoints: OpenAI ``POST /v1/completions`` and
``POST /v1/chat/completions`` for a causal-lm model, whole or streamed as server-sent events.

A request becomes one `dynbatchd.protocol.Request` with ``generate`` options (``max_tokens`` ->
max_new_tokens, ``temperature``, ``top_k``, ``seed``, ``stop``) through the daemon's `LocalDoor`:
``infer`` for a whole answer, ``stream`` for ``"stream": true``, whose chunks become ``data:``
events as the worker produces them, then ``data: [DONE]``. A chat's messages become one prompt
by `chat_prompt` (no model chat template). OpenAI options with no generate key are refused
unless they ask for the default (``n`` 1, ``top_p`` 1, no ``logprobs``); others (penalties,
``logit_bias``) are ignored.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import msgspec

from dynbatchd import protocol as P

from .httpwire import STATUS, HttpError, bad_output, body_tags, request_meta

# OpenAI's name of each generate option (max_completion_tokens: the chat API's newer name)
OPTIONS = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "temperature": "temperature",
           "top_k": "top_k", "seed": "seed", "stop": "stop"}
# options with no generate key: accepted only as their default (or null); the chat API's logprobs is a
# boolean (false by default), the completions API's a count (null by default)
DEFAULT_ONLY = {"n": 1, "top_p": 1, "best_of": 1, "echo": False, "logprobs": False, "suffix": ""}
GENERATIVE = ("completions", "chat_completions")   # handlers a client's hang-up cancels (plugins.http)
ROLES = ("system", "user", "assistant", "tool", "developer")


def chat_prompt(messages: Any) -> str:
    """The chat as one prompt: a line ``ROLE: CONTENT`` per message, then ``assistant:`` for the
    model to continue. Content is a string or a list of ``{"type": "text", "text"}`` parts."""
    if not isinstance(messages, list) or not messages:
        raise HttpError(P.BAD_REQUEST, "\"messages\" must be a non-empty list of {\"role\", \"content\"}")
    lines = []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)
        if role not in ROLES or not isinstance(content, str):
            raise HttpError(P.BAD_REQUEST, "each message needs a \"role\" (system, user, assistant, tool, "
                                           "developer) and a text \"content\"")
        lines.append(f"{role}: {content}\n")
    return "".join(lines) + "assistant:"


def generate_options(body: dict[str, Any]) -> dict[str, Any]:
    """The request's generate map from the OpenAI body (the front end checks each value, naming it)."""
    options: dict[str, Any] = {}
    for name, key in OPTIONS.items():
        value = body.get(name)
        if value is None:
            continue
        if name == "stop" and isinstance(value, str):
            value = [value]
        options[key] = value
    for name, default in DEFAULT_ONLY.items():
        value = body.get(name)
        if value is not None and (value != default or isinstance(value, bool) != isinstance(default, bool)):
            raise HttpError(P.BAD_REQUEST, f"\"{name}\" is not supported here (only "
                                           f"{msgspec.json.encode(default).decode()} or null)")
    if (problem := P.check_generate(options)) is not None:   # the front end's check, naming the client's key
        sent = next((name for name, key in OPTIONS.items()
                     if body.get(name) is not None and problem.startswith(f"generate.{key} ")), None)
        raise HttpError(P.BAD_REQUEST, f"\"{sent}\" {problem.partition(' ')[2]}" if sent else problem)
    return options


class EventStream:
    """A streamed completion as server-sent events: ``async for`` gives the bytes of each event
    (a chunk object per `P.Chunk`, a last one with the finish reason, usage if asked, ``[DONE]``;
    an error that ends it after a chunk is an ``{"error": ...}`` event before ``[DONE]``). `close`
    before the end withdraws the request (the client hung up). `first`: the stream's first item,
    already taken: the handler waits for it to choose the status, so an error before any chunk is
    answered with its own status there and never reaches the stream."""

    def __init__(self, stream: Any, shape: dict[str, Any], chat: bool, usage: bool, first: Any = None):
        self.stream, self.shape, self.chat, self.usage = stream, shape, chat, usage
        self.done = False
        self._sent = 0
        self._first = first

    def __aiter__(self) -> "EventStream":
        return self

    def _event(self, choice: dict[str, Any] | None, **extra: Any) -> bytes:
        body = {**self.shape, "choices": [] if choice is None else [choice], **extra}
        return b"data: " + msgspec.json.encode(body) + b"\n\n"

    def _choice(self, text: str | None, finish: str | None) -> dict[str, Any]:
        if not self.chat:
            return {"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish}
        delta = {} if text is None else {"content": text}
        if not self._sent:
            delta = {"role": "assistant", **delta}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    async def __anext__(self) -> bytes:
        if self.done:
            raise StopAsyncIteration
        item, self._first = self._first, None
        if item is None:
            item = await self.stream.__anext__()
        if isinstance(item, P.Chunk):
            event = self._event(self._choice(item.text, None))
            self._sent += 1
            return event
        self.done = True
        if item.code != "ok":
            error = {"code": item.code, "message": item.message, "status": STATUS.get(item.code, 500)}
            return b"data: " + msgspec.json.encode({"error": error}) + b"\n\ndata: [DONE]\n\n"
        value = item.output[0] if isinstance(item.output[0], dict) else {}
        events = [self._event(self._choice(None if self.chat else "", value.get("finish_reason")))]
        if self.usage:
            events.append(self._event(None, usage=usage(value)))
        return b"".join(events) + b"data: [DONE]\n\n"

    def close(self) -> None:
        self.done = True
        self.stream.close()


def usage(value: dict[str, Any]) -> dict[str, int]:
    prompt, completion = value.get("prompt_tokens", 0), value.get("output_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class HttpGenerate:
    """The two handlers, as methods of the door (`self.api`: the daemon's LocalDoor)."""

    api: Any
    _json: Any   # HttpEndpoints._json

    async def completions(self, _: None, headers: dict[str, str], raw: bytes) -> tuple[int, Any]:
        body = self._json(raw)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise HttpError(P.BAD_REQUEST, "\"prompt\" must be a string (one prompt a request)")
        return await self._generate(body, headers, prompt, chat=False)

    async def chat_completions(self, _: None, headers: dict[str, str], raw: bytes) -> tuple[int, Any]:
        body = self._json(raw)
        return await self._generate(body, headers, chat_prompt(body.get("messages")), chat=True)

    async def _generate(self, body: dict[str, Any], headers: dict[str, str], prompt: str,
                        chat: bool) -> tuple[int, Any]:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise HttpError(P.BAD_REQUEST, "\"model\" must name a model")
        if model not in self.api.models:
            raise HttpError(P.UNKNOWN_MODEL, f"no model named {model!r}")
        if not self.api.generative(model):
            raise HttpError(P.BAD_REQUEST, f"model {model!r} does not generate text (its runner is not causal-lm)")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise HttpError(P.BAD_REQUEST, "\"stream\" must be true or false")
        meta = request_meta(headers)
        if isinstance(body.get("user"), str):
            meta.setdefault("user", body["user"])
        body_tags(body.get("tags"), meta)
        tenant, channels = meta.pop("_caller", (None, ()))
        rid = meta.pop("_request_id", None) or uuid.uuid4().hex
        request = P.Request(rid, model, text=prompt, generate=generate_options(body), stream=stream, **meta)
        shape = {"id": ("chatcmpl-" if chat else "cmpl-") + rid, "created": int(time.time()), "model": model,
                 "object": ("chat.completion" if chat else "text_completion")}
        if stream:
            local = self.api.stream(request, tenant=tenant, channels=channels)
            try:   # the status waits for the first token: an error before it (refused at once, too large
                first = await local.__anext__()   # for the KV budget, deadline) is its own status, not 200
            except BaseException:   # (cancelled: the client hung up first) withdrawn
                local.close()
                raise
            if not isinstance(first, P.Chunk) and first.code != "ok":
                self._refused(first, meta)
            if chat:
                shape["object"] = "chat.completion.chunk"
            options = body.get("stream_options")
            include_usage = isinstance(options, dict) and options.get("include_usage") is True
            return 200, EventStream(local, shape, chat, include_usage, first)
        future = self.api.infer(request, tenant=tenant, channels=channels)
        try:
            answer = await asyncio.shield(future)   # (cancelling this handler must not cancel the future)
        finally:
            if not future.done():   # this handler was cancelled (the connection went): withdraw
                self.api.withdraw(future)
        if answer.code != "ok":
            self._refused(answer, meta)
        value = answer.output[0]
        if not isinstance(value, dict) or not isinstance(value.get("text"), str):
            raise bad_output(model, "no generated text")
        text = value["text"]
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                  else {"index": 0, "text": text, "logprobs": None})
        return 200, {**shape, "choices": [{**choice, "finish_reason": value["finish_reason"]}], "usage": usage(value)}

    def _refused(self, answer: Any, meta: dict[str, Any]) -> None:
        error = HttpError(answer.code, answer.message)
        if answer.code == P.QUOTA_EXCEEDED:   # when its tenant's bucket holds a request again
            error.retry_after = self.api.retry_after(meta.get("tenant"))
        raise error
