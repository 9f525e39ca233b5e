"""Wire messages between clients, the daemon and its workers.

One request is a ZeroMQ multipart message: a msgpack header followed by
optional raw frames that hold array data (referenced from the header by frame
index, so arrays never pass through msgpack). A reply has the same shape.
The full format is documented in man/dynbatchd-protocol.7.
"""

from __future__ import annotations

from typing import Any

import msgspec

from dynbatchd.errors import DynbatchdError

PROTOCOL_VERSION = 1

# Error codes: stable strings, part of the public protocol.
BAD_REQUEST = "bad_request"
UNKNOWN_MODEL = "unknown_model"
OVERLOADED = "overloaded"
DEADLINE_EXCEEDED = "deadline_exceeded"
MODEL_ERROR = "model_error"
SHUTTING_DOWN = "shutting_down"
REFUSED = "refused"
UNAVAILABLE = "unavailable"   # every device was given up: retrying here will not help, try another daemon
CANCELLED = "cancelled"       # the client cancelled the request while it was still queued
QUOTA_EXCEEDED = "quota_exceeded"   # its tenant is over its [quotas] rate or in-flight bound: retry later
ERROR_CODES = (BAD_REQUEST, UNKNOWN_MODEL, OVERLOADED, DEADLINE_EXCEEDED, MODEL_ERROR,
               SHUTTING_DOWN, REFUSED, UNAVAILABLE, CANCELLED, QUOTA_EXCEEDED)

DTYPES = ("float32", "float16", "float64", "int64", "int32", "uint8", "bool")


class TensorRef(msgspec.Struct, omit_defaults=True, gc=False):
    """An array carried in raw frame number `frame` (0 = first frame after the header)."""
    dtype: str
    shape: list[int]
    frame: int = 0


class Request(msgspec.Struct, omit_defaults=True, gc=False):
    """What a client sends. Exactly one of text / tensor / value is the input."""
    id: int | str
    model: str = ""                 # required, but for a cancel
    v: int = PROTOCOL_VERSION
    text: str | None = None
    tensor: TensorRef | None = None
    value: Any = None
    tags: list[str] = []
    request_type: str | None = None
    user_frequency: str | None = None
    user: str | None = None
    tenant: str | None = None
    tokens: int | None = None
    priority: int | None = None
    deadline_ms: float | None = None
    cancel: bool = False            # {"id": ID, "cancel": true}: withdraw request ID sent on this connection
    stream: bool = False            # a generative model: send Chunk frames before the final reply
    generate: dict[str, Any] | None = None   # per-request generation options (GENERATE_KEYS)


# A tenant is a name: the quota table, the top-users sketch and the answers per tenant keep it, up
# to 100,000 of them (a client naming a new tenant of 64 KiB per request grew the daemon by as much).
MAX_TENANT_CHARS = 1024

# The keys of a request's `generate` map, each checked as the causal-lm runner checks its option.
GENERATE_KEYS = ("max_new_tokens", "temperature", "top_k", "seed", "stop")
# The runner looks for every stop string after every token of the request: bounded, so one request
# cannot slow the batch it shares (45,000 made every stream's token ~60x slower). OpenAI allows 4.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def check_generate(options: Any) -> str | None:
    """Why a request's `generate` map is wrong (naming the key), or None."""
    if not isinstance(options, dict):
        return "generate must be a map"
    for key, value in options.items():
        if key not in GENERATE_KEYS:
            return f"generate.{key} is not a generation option (known: {', '.join(GENERATE_KEYS)})"
        if key == "stop":
            good = isinstance(value, list) and all(isinstance(s, str) and s for s in value)
            expected = "a list of non-empty strings"
            if good and len(value) > MAX_STOP_STRINGS:   # (counts, not the value: it may be long)
                return f"generate.stop must be at most {MAX_STOP_STRINGS} strings, got {len(value)}"
            if good and (longest := max(map(len, value), default=0)) > MAX_STOP_CHARS:
                return f"generate.stop strings must be at most {MAX_STOP_CHARS} characters each, got one of {longest}"
        elif key == "temperature":
            good = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 100
            expected = "a number from 0 to 100"
        else:
            low = 1 if key == "max_new_tokens" else 0
            good = isinstance(value, int) and not isinstance(value, bool) and low <= value <= 1 << 31
            expected = f"an integer >= {low}"
        if not good:
            return f"generate.{key} must be {expected}, got {value!r}"
    return None


class Chunk(msgspec.Struct, omit_defaults=False, gc=False):
    """A streamed request's partial reply: `text` new since chunk `chunk - 1` (numbered from 0),
    covering `tokens` tokens. It has no `ok` key: that is how a client tells it from the final reply."""
    id: int | str
    chunk: int
    text: str
    tokens: int


def estimate_tokens(request: Request) -> int:
    """The client's token count, else ~4 characters per token for text (routing and costs use it)."""
    if request.tokens is not None:
        return request.tokens
    if request.text is not None:
        return len(request.text) // 4 + 1
    return 0


class ErrorInfo(msgspec.Struct, gc=False):
    code: str
    message: str


class Timing(msgspec.Struct, omit_defaults=True, gc=False):
    """Where the request's time went, in microseconds: queue_us is everything but
    compute_us (waiting in its channel, for its batch, and behind the batch ahead)."""
    queue_us: int = 0
    compute_us: int = 0
    total_us: int = 0
    batch_size: int = 0
    channel: str = ""
    device: str = ""
    simulated: bool = False
    ttft_us: int = 0        # a generated reply: acceptance to the first token
    tpot_us: int = 0        # a generated reply: mean time per output token after the first
    preemptions: int = 0    # a generated reply: times its KV was dropped and recomputed


class Reply(msgspec.Struct, omit_defaults=True, gc=False):
    id: int | str | None
    ok: bool
    v: int = PROTOCOL_VERSION
    tensor: TensorRef | None = None
    value: Any = None
    error: ErrorInfo | None = None
    timing: Timing | None = None


# --- daemon <-> worker (ipc) --------------------------------------------------

class BatchItem(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    text: str | None = None
    tensor: TensorRef | None = None
    value: Any = None
    tokens: int = 0


class BatchMsg(msgspec.Struct, array_like=True, gc=False, tag="batch"):
    batch_id: int
    model: str
    items: list[BatchItem]


class BatchResult(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="result"):
    """A worker's answer: a stacked output array (frame 0) or per-item values,
    plus per-item errors (index -> message) for items that failed alone, and
    the items the model refused before running (index -> why: bad_request)."""
    batch_id: int
    compute_ns: int
    output: TensorRef | None = None
    values: list[Any] | None = None
    errors: dict[int, str] = {}
    oom: bool = False
    simulated: bool = False
    rejected: dict[int, str] = {}
    prepare_ns: int = 0   # the worker's CPU stage before the device (decode, tokenise; 0: not measured)
    memory_bytes: int = 0   # torch's peak allocated bytes on the device during the batch (0: not measured)


class ModelSpec(msgspec.Struct, gc=False):
    name: str
    runner: str
    options: dict[str, Any] = {}


class Setup(msgspec.Struct, array_like=True, gc=False, tag="setup"):
    device: str
    models: list[ModelSpec]
    threads: int = 0


class Hello(msgspec.Struct, array_like=True, gc=False, tag="hello"):
    pid: int


class Ready(msgspec.Struct, array_like=True, gc=False, tag="ready"):
    pid: int
    device: str
    models: list[str]
    simulated: list[str] = []
    failed: dict[str, str] = {}   # models of a reload's Setup it could not load: "ErrorType: message"


class Failed(msgspec.Struct, array_like=True, gc=False, tag="failed"):
    message: str


class GenerateJob(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="generate"):
    """A generative request for the worker's step loop: its prompt, options and channel's targets.
    `deadline_ms`: milliseconds left when sent (None: none)."""
    job: int
    model: str
    prompt: str
    options: dict[str, Any] = {}
    channel: str = ""
    priority: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    deadline_ms: float | None = None


class GenerateCancel(msgspec.Struct, array_like=True, gc=False, tag="gencancel"):
    job: int
    reason: str = CANCELLED     # or deadline_exceeded


class GenTokens(msgspec.Struct, array_like=True, gc=False, tag="gentokens"):
    """One step's new text per job: [job, text, tokens] each (coalesced per sequence)."""
    items: list[tuple[int, str, int]]


class GenEnd(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="genend"):
    """A job's end: why (length, stop, cancelled, deadline_exceeded, too_large, error), its counts and
    times in microseconds since the worker took it."""
    job: int
    reason: str
    output_tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""
    ttft_us: int = 0
    tpot_us: int = 0
    total_us: int = 0
    preemptions: int = 0
    message: str = ""
    kv_in_use_bytes: int = 0     # the worker's KV ledger after this end (0 once nothing runs)


WorkerToDaemon = Hello | Ready | BatchResult | Failed | GenTokens | GenEnd
DaemonToWorker = Setup | BatchMsg | GenerateJob | GenerateCancel

request_decoder = msgspec.msgpack.Decoder(Request)
_id_decoder = msgspec.msgpack.Decoder(type("_IdOnly", (msgspec.Struct,), {"__annotations__": {"id": Any}, "id": None}))
reply_decoder = msgspec.msgpack.Decoder(Reply)
chunk_decoder = msgspec.msgpack.Decoder(Chunk)
worker_decoder = msgspec.msgpack.Decoder(WorkerToDaemon)
daemon_decoder = msgspec.msgpack.Decoder(DaemonToWorker)


def _encode_extra(obj: Any) -> Any:
    """Let numpy scalars and arrays inside plain values travel as msgpack numbers and lists."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise NotImplementedError(f"cannot send a {type(obj).__name__} in a message")


encoder = msgspec.msgpack.Encoder(enc_hook=_encode_extra)


# What numpy can hold, whatever the frame says: a shape of 65 dimensions, or a zero-size one with a
# dimension of 2**63 (0 elements match an empty frame), passed the byte count and then killed the
# worker that reshaped it (numpy 1.x holds 32 dimensions, 2.x 64; each in an intp).
MAX_TENSOR_DIMS = 32
MAX_DIMENSION = 2**31 - 1


def check_tensor(ref: TensorRef, frame_lengths: list[int]) -> str | None:
    """Return why `ref` does not describe one of the frames, or None if it does."""
    if ref.dtype not in DTYPES:
        return f"unsupported dtype {ref.dtype!r}"
    if not 0 <= ref.frame < len(frame_lengths):
        return f"tensor frame {ref.frame} is missing"
    if len(ref.shape) > MAX_TENSOR_DIMS:
        return f"tensor shape has {len(ref.shape)} dimensions (at most {MAX_TENSOR_DIMS})"
    if any(d < 0 for d in ref.shape):
        return "negative dimension in tensor shape"
    if any(d > MAX_DIMENSION for d in ref.shape):
        return f"tensor dimension over {MAX_DIMENSION}"
    count = 1
    for d in ref.shape:
        count *= d
    itemsize = {"float32": 4, "float16": 2, "float64": 8, "int64": 8, "int32": 4,
                "uint8": 1, "bool": 1}[ref.dtype]
    if count * itemsize != frame_lengths[ref.frame]:
        return f"tensor shape {ref.shape} x {ref.dtype} does not match frame of {frame_lengths[ref.frame]} bytes"
    return None


# --- decoding what strangers send ------------------------------------------------

MAX_NESTING = 32   # deepest array/map a header's free-form values may hold


class MalformedMessage(DynbatchdError, ValueError):
    """A message that cannot be decoded: answered ``bad_request``, never raised further."""


def too_deep(value: Any, limit: int = MAX_NESTING) -> bool:
    """True when `value` nests lists/dicts more than `limit` levels (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        obj, depth = stack.pop()
        if isinstance(obj, dict):
            children = obj.values()
        elif isinstance(obj, list):
            children = obj
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (list, dict)))
    return False


def decode_checked(decoder: msgspec.msgpack.Decoder, raw: bytes, what: str, *free_form: str) -> Any:
    """Decode `raw`, turning every failure into MalformedMessage.

    msgspec raises RecursionError (not DecodeError) on a deeply nested value; a
    header that decodes is still refused when one of its `free_form` fields nests
    deeper than MAX_NESTING, so no later walk over it can exhaust the stack.
    """
    try:
        msg = decoder.decode(raw)
    except RecursionError:
        raise MalformedMessage(f"malformed {what}: nested deeper than {MAX_NESTING} levels") from None
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        raise MalformedMessage(f"malformed {what}: {exc}") from None
    for name in free_form:
        value = getattr(msg, name)
        if isinstance(value, (list, dict)) and too_deep(value):   # (a scalar or None: nothing to walk)
            raise MalformedMessage(f"malformed {what}: {name} nested deeper than {MAX_NESTING} levels")
    return msg


def decode_request(raw: bytes) -> Request:
    """A request header by `decode_checked`'s rules, the common case first (this runs per request):
    anything it refuses goes through `decode_checked` again for its MalformedMessage."""
    try:
        request = request_decoder.decode(raw)
    except Exception:
        return decode_checked(request_decoder, raw, "request header", "value")
    if isinstance(request.value, (list, dict)) and too_deep(request.value):
        return decode_checked(request_decoder, raw, "request header", "value")
    return request


def guess_id(raw: bytes) -> int | str | None:
    """Best effort: the id of a request that failed to decode, so the client can match the error."""
    try:
        rid = _id_decoder.decode(raw).id
    except Exception:   # too deep, truncated...: read the id if it is the header's first key
        rid = _leading_id(raw)
    return rid if isinstance(rid, (int, str)) and not isinstance(rid, bool) else None


_INTS = {0xcc: ">B", 0xcd: ">H", 0xce: ">I", 0xcf: ">Q", 0xd0: ">b", 0xd1: ">h", 0xd2: ">i", 0xd3: ">q"}


def _leading_id(raw: bytes) -> int | str | None:
    """The value of an `id` key that opens a msgpack map (ints and short strings), read by hand."""
    import struct

    start = {0xde: 3, 0xdf: 5}.get(raw[0], 1) if raw and (0x80 <= raw[0] <= 0x8f or raw[0] in (0xde, 0xdf)) else 0
    if not start or raw[start:start + 3] != b"\xa2id":
        return None
    at = start + 3
    tag = raw[at] if at < len(raw) else None
    if tag is None:
        return None
    if tag <= 0x7f or tag >= 0xe0:
        return tag if tag <= 0x7f else tag - 256
    if tag in _INTS:
        size = struct.calcsize(_INTS[tag])
        chunk = raw[at + 1:at + 1 + size]
        return struct.unpack(_INTS[tag], chunk)[0] if len(chunk) == size else None
    if 0xa0 <= tag <= 0xbf or tag == 0xd9:
        length, at = (tag - 0xa0, at + 1) if tag != 0xd9 else (raw[at + 1] if at + 1 < len(raw) else -1, at + 2)
        text = raw[at:at + length]
        try:
            return text.decode() if len(text) == length >= 0 else None
        except UnicodeDecodeError:
            return None
    return None
