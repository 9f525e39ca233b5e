"""A tiny random causal LM and word-level tokenizer, built offline, for tests and the CPU benchmark.

Nothing is downloaded: the Llama config (2 layers, 64 hidden, grouped KV heads) and the
tokenizer are made here and saved with `save_pretrained`, so `causal-lm` loads them as it would
any local model directory. The weights are random (fixed seed): its text is nonsense, its
arithmetic (positions, KV cache, padding) is a real decoder's.
"""

from __future__ import annotations

from pathlib import Path

WORDS = [f"w{i}" for i in range(60)] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
SPECIALS = ["<unk>", "<eos>", "<pad>"]


def build_tiny_causal_lm(path: str | Path, *, seed: int = 0, layers: int = 2, hidden: int = 64,
                         max_positions: int = 512, eos: bool = True) -> Path:
    """Write a tiny Llama model and its tokenizer to `path`; returns `path`. `max_positions`: its
    context (the benchmark's mixed workload needs 2,048 + 512); ``eos=False`` gives the model no
    end token, so every answer runs to its `max_new_tokens` (a benchmark's output lengths hold)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>",
                                        pad_token="<pad>")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions,
                         eos_token_id=vocab["<eos>"] if eos else None, pad_token_id=vocab["<pad>"],
                         bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():               # larger logits than the default init: fewer near-ties
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
