"""The end-to-end cases' model: a tiny random Llama (GQA, several blocks per prompt) saved with
``save_pretrained``, its prompts, and the reference greedy tokens from Hugging Face transformers."""

from __future__ import annotations

import random
from pathlib import Path

import torch

NUM_HEADS, NUM_KV_HEADS = 4, 2
PROMPT_LENGTHS = (5, 19, 30)
"""Prompts longer than a block, chunked by a small token budget; the last starts with the whole
second (a prefix-cache hit of its full blocks)."""
MAX_TOKENS = 6


def write_tiny_llama(directory: Path, head_size: int) -> str:
    """Save a 2-layer random Llama whose attention heads have ``head_size`` in ``directory``; no
    tokenizer (the cases pass token ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=NUM_HEADS * head_size,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=head_size,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    # Larger weights than the default init make logits peaked, so rounding differences between
    # attention implementations cannot flip a float32 greedy argmax.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.08)
    model.save_pretrained(directory)
    return str(directory)


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    out = [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]
    out[2][: len(out[1])] = out[1]
    return out


def hf_greedy(directory: str, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, in float32 on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    results = []
    with torch.no_grad():
        for prompt in prompt_ids:
            ids = list(prompt)
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            results.append(ids[len(prompt) :])
    return results
