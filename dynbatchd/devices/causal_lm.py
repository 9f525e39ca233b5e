"""The `causal-lm` runner: a Hugging Face decoder, stepped one token boundary at a time.

Continuous batching needs a runner that works per iteration, not per request: `add` a sequence,
`prefill` the new ones (batched; each keeps its own KV cache), `decode_step` the running set (one token
each, batched), `remove` or `preempt` one at a token boundary (its KV is dropped at once). Each
sequence keeps its KV as its own per-layer tensors; a decode step left-pads them to the longest,
masks the padding and gives every sequence its own position, so a batched step computes the same
greedy tokens as the sequence alone (tests check it). The copy in and out of the batch costs
O(KV) per step: a paged cache would avoid it and is not built.

Options: ``path`` (a local model directory; nothing is downloaded), ``dtype`` ("auto": the
model's), ``max_new_tokens``, ``temperature`` (0, or below MIN_TEMPERATURE: greedy), ``top_k``,
``seed``, ``stop`` (strings that end a generation, not included in its text);
``kv_budget_tokens``, ``max_batch_sequences``, ``max_prefill_tokens`` and ``mode`` configure the
worker's step loop (dynbatchd.generation.serving), through which the daemon serves every request
for this runner. `run` generates a whole batch of prompts (one-shot use outside the daemon:
benchmarks, tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dynbatchd import protocol as P
from dynbatchd.devices.runners import Runner, count, encoder_dir, one_of
from dynbatchd.generation.simcosts import simulated_costs

DTYPES = ("auto", "float32", "float16", "bfloat16")
# Below it a temperature samples as greedy: logits / T would overflow float32 (1e-308 made every
# logit inf, softmax NaN, and the step raise), and 1/T that sharp picks the top token anyway.
MIN_TEMPERATURE = 1e-5


def non_negative(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return f"expected a number >= 0, got {value!r}"
    return None


def flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"expected true or false, got {value!r}"


def stop_strings(value: Any) -> str | None:
    """The `stop` option's rule: a request's (`protocol.check_generate`), as every token is checked
    against each string."""
    if not (isinstance(value, list) and all(isinstance(s, str) and s for s in value)):
        return f"expected a list of non-empty strings, got {value!r}"
    if len(value) > P.MAX_STOP_STRINGS or max(map(len, value), default=0) > P.MAX_STOP_CHARS:
        return f"at most {P.MAX_STOP_STRINGS} strings of at most {P.MAX_STOP_CHARS} characters each"
    return None


@dataclass(frozen=True)
class TokenEvent:
    """One sequence's token of one step: the new text (after stop handling) and why it ended, if it did."""
    seq_id: str
    token_id: int
    text: str
    finished: str | None = None          # "length", "stop" (EOS or a stop string), "error", or None
    error: str = ""                      # finished "error": what went wrong with this sequence alone


@dataclass
class GenSequence:
    prompt_ids: list[int]
    max_new_tokens: int
    stop: tuple[str, ...]
    temperature: float
    top_k: int
    generator: Any = None                # a seeded torch.Generator when sampling
    generated: list[int] = field(default_factory=list)
    kv: list[tuple[Any, Any]] | None = None   # per layer (keys, values), each [1, kv_heads, tokens, head_dim]
    text: str = ""                       # the text sent so far (`full` less a possible stop string's start)
    full: str = ""
    finished: str | None = None

    @property
    def kv_tokens(self) -> int:
        return 0 if self.kv is None else int(self.kv[0][0].shape[-2])


class CausalLMRunner(Runner):
    NAME = "causal-lm"
    OPTIONS = {"path": encoder_dir, "dtype": one_of(*DTYPES), "max_new_tokens": count(1),
               "temperature": non_negative, "top_k": count(0), "seed": count(0), "stop": stop_strings,
               # the worker's generation loop (dynbatchd.generation.serving): KV budget and step limits
               "kv_budget_tokens": count(1), "max_batch_sequences": count(1), "max_prefill_tokens": count(1),
               "mode": one_of("continuous", "static"), "tpot_guard": flag,
               "simulated": simulated_costs}   # the simulated device's step costs (dynbatchctl simulate)
    REQUIRED = {"path": 'the model directory (path = "/srv/models/my-model")'}

    def __init__(self, device: str, options: dict[str, Any]):
        super().__init__(device, options)
        self.sequences: dict[str, GenSequence] = {}
        self.model = self.tokenizer = None

    def load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtype = self.options.get("dtype", "auto")
        self.tokenizer = AutoTokenizer.from_pretrained(self.options["path"], local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.options["path"], local_files_only=True, dtype=dtype if dtype == "auto" else getattr(torch, dtype))
        self.model.to(self.device).eval()
        self.eos = self.model.config.eos_token_id

    def check(self, item: Any) -> str | None:
        """A prompt is text; an empty one has nothing to continue."""
        if not isinstance(item, str) or not item.strip():
            return "causal-lm takes a non-empty prompt string"
        return None

    # -- sequences in and out ----------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def add(self, seq_id: str, prompt: str | list[int], *, max_new_tokens: int | None = None,
            stop: list[str] | None = None, temperature: float | None = None, top_k: int | None = None,
            seed: int | None = None) -> GenSequence:
        """Register a sequence; it computes nothing until `prefill`."""
        import torch

        if seq_id in self.sequences:
            raise ValueError(f"sequence {seq_id!r} already exists")
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("an empty prompt has nothing to continue")
        o = self.options
        temperature = o.get("temperature", 0.0) if temperature is None else temperature
        generator = None
        if temperature >= MIN_TEMPERATURE:
            generator = torch.Generator().manual_seed(o.get("seed", 0) if seed is None else seed)
        new = max_new_tokens or o.get("max_new_tokens", 64)
        if (limit := self.max_context) is not None and len(ids) + new > limit:   # (a crash mid-batch, else)
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({new}) is longer than the model's "
                             f"context ({limit} tokens)")
        seq = GenSequence(ids, new, tuple(stop or o.get("stop", ())),
                          temperature, o.get("top_k", 0) if top_k is None else top_k, generator)
        self.sequences[seq_id] = seq
        return seq

    @property
    def max_context(self) -> int | None:
        """The most positions the loaded model takes (its config's max_position_embeddings or
        n_positions); None before `load` or when the config does not say."""
        config = getattr(self.model, "config", None)
        return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)

    def remove(self, seq_id: str) -> GenSequence | None:
        """Forget a sequence (finished or cancelled): its KV tensors are released at once."""
        seq = self.sequences.pop(seq_id, None)
        if seq is not None:
            seq.kv = None
        return seq

    def preempt(self, seq_id: str) -> None:
        """Drop a sequence's KV but keep its tokens: its next `prefill` recomputes prompt + output."""
        self.sequences[seq_id].kv = None

    def kv_tokens(self) -> int:
        return sum(s.kv_tokens for s in self.sequences.values())

    # -- one iteration -------------------------------------------------------------------------
    def prefill(self, seq_ids: list[str] | tuple[str, ...]) -> list[TokenEvent]:
        """Build each sequence's KV over its prompt (and, after preemption, its output so far) and
        produce its next token: one forward over the prompts left-padded to the longest, masked,
        each with its own positions; the padding's KV is cut off after."""
        import torch
        from transformers import DynamicCache

        if not seq_ids:
            return []
        seqs = [self.sequences[i] for i in seq_ids]
        contexts = [s.prompt_ids + s.generated for s in seqs]
        longest = max(map(len, contexts))
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([[pad_id] * (longest - len(c)) + c for c in contexts], device=self.device)
        mask = torch.tensor([[0] * (longest - len(c)) + [1] * len(c) for c in contexts], device=self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        events = []
        for row, (seq_id, seq) in enumerate(zip(seq_ids, seqs)):
            pad = longest - len(contexts[row])
            seq.kv = [(layer.keys[row:row + 1, :, pad:].clone(), layer.values[row:row + 1, :, pad:].clone())
                      for layer in cache.layers]
            events.append(self._next_alone(seq_id, seq, out.logits[row, -1]))
        return events

    def decode_step(self, seq_ids: list[str] | tuple[str, ...]) -> list[TokenEvent]:
        """One token for each running sequence, in one batched forward over their left-padded KV."""
        import torch
        from transformers import DynamicCache

        if not seq_ids:
            return []
        seqs = [self.sequences[i] for i in seq_ids]
        lengths = [s.kv_tokens for s in seqs]
        longest = max(lengths)
        cache = DynamicCache()
        for layer in range(len(seqs[0].kv)):
            keys = torch.cat([_left_pad(s.kv[layer][0], longest) for s in seqs])
            values = torch.cat([_left_pad(s.kv[layer][1], longest) for s in seqs])
            cache.update(keys, values, layer)
        mask = torch.zeros(len(seqs), longest + 1, dtype=torch.long, device=self.device)
        for row, length in enumerate(lengths):
            mask[row, longest - length:] = 1
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([[s.generated[-1]] for s in seqs], device=self.device),
                             attention_mask=mask, position_ids=torch.tensor([[n] for n in lengths], device=self.device),
                             cache=cache, use_cache=True)
        events = []
        for row, (seq_id, seq) in enumerate(zip(seq_ids, seqs)):
            pad = longest - lengths[row]
            seq.kv = [(layer.keys[row:row + 1, :, pad:].clone(), layer.values[row:row + 1, :, pad:].clone())
                      for layer in cache.layers]
            events.append(self._next_alone(seq_id, seq, out.logits[row, -1]))
        return events

    def _next_alone(self, seq_id: str, seq: GenSequence, logits: Any) -> TokenEvent:
        """`_next`, but a failure there ends this sequence alone (finished "error"): the step's
        forward pass was the model's, this token is one sequence's, and the others go on."""
        try:
            return self._next(seq_id, seq, logits)
        except Exception as exc:   # no text: an exception's may quote the sequence's
            seq.finished, seq.kv = "error", None
            return TokenEvent(seq_id, -1, "", "error", f"its next token failed ({type(exc).__name__})")

    def _next(self, seq_id: str, seq: GenSequence, logits: Any) -> TokenEvent:
        token = _pick(logits, seq)
        if token == self.eos:   # the end: a tail held back for a stop string that never came goes now
            seq.finished, delta, seq.text = "stop", seq.full[len(seq.text):], seq.full
            seq.kv = None
            return TokenEvent(seq_id, token, delta, "stop")
        seq.generated.append(token)
        text = self.tokenizer.decode(seq.generated, skip_special_tokens=True)
        hit = min((text.find(s) for s in seq.stop if s in text), default=-1)
        if hit >= 0:
            text, seq.finished = text[:hit], "stop"
        elif len(seq.generated) >= seq.max_new_tokens:
            seq.finished = "length"
        seq.full = text
        if not seq.finished:   # hold back a tail that could still become a stop string: never sent
            text = text[:len(text) - _held_tail(text, seq.stop)]
        delta, seq.text = text[len(seq.text):], text
        if seq.finished:
            seq.kv = None             # ended: its KV goes now, its tokens stay until `remove`
        return TokenEvent(seq_id, token, delta, seq.finished)

    # -- the one-shot interface ------------------------------------------------------------------
    def generate(self, prompts: list[str]) -> list[str]:
        """Every prompt to its end, all in one continuously batched loop."""
        ids = [f"run-{i}" for i in range(len(prompts))]
        for seq_id, prompt in zip(ids, prompts):
            self.add(seq_id, prompt)
        try:
            self.prefill(ids)
            running = [i for i in ids if not self.sequences[i].finished]
            while running:
                self.decode_step(running)
                running = [i for i in running if not self.sequences[i].finished]
            return [self.sequences[i].text for i in ids]
        finally:
            for seq_id in ids:
                self.remove(seq_id)

    def run(self, inputs, tokens):
        return self.generate([str(x) for x in inputs])


def _held_tail(text: str, stops: tuple[str, ...]) -> int:
    """The length of `text`'s longest end that is the start of a stop string (0: none). Run per token
    per sequence, so cheap: for each stop only the places in the text's last len(stop) - 1 characters
    where the stop's first character is are tried (found in C), longest first, until one starts it."""
    best = 0
    for stop in stops:
        tail = text[len(text) - min(len(stop) - 1, len(text)):]
        at = tail.find(stop[0])
        while 0 <= at < len(tail) - best:
            if stop.startswith(tail[at:]):
                best = len(tail) - at
                break
            at = tail.find(stop[0], at + 1)
    return best


def _left_pad(tensor: Any, length: int) -> Any:
    import torch

    missing = length - tensor.shape[-2]
    if not missing:
        return tensor
    shape = (*tensor.shape[:-2], missing, tensor.shape[-1])
    return torch.cat([tensor.new_zeros(shape), tensor], dim=-2)


def _pick(logits: Any, seq: GenSequence) -> int:
    """Greedy below MIN_TEMPERATURE, else top-k sampling from the sequence's own seeded generator.
    A row whose probabilities are still not finite (a model's own inf or NaN logits) takes its
    top token: torch.multinomial would raise, and one sequence must not fail the step."""
    import torch

    if seq.temperature < MIN_TEMPERATURE:
        return int(torch.argmax(logits))
    scaled = logits.float().cpu() / seq.temperature
    if seq.top_k:
        kth = torch.topk(scaled, min(seq.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, -1)
    if not bool(torch.isfinite(probs).all()):
        return int(torch.argmax(logits))
    return int(torch.multinomial(probs, 1, generator=seq.generator))
