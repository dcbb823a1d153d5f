"""Qwen2 and Qwen3 GGUF files (written by the `gguf` package's GGUFWriter from tiny random HF
models, linear weights in Q8_0/Q4_0/Q4_1) served by pagellm on the CPU, greedy token for token
against transformers loading the same file (its own GGUF reader: the oracle)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_files import write_tiny_gguf

from pagellm import LLM, SamplingParams

TYPES = {
    "attn_q": T.Q8_0,
    "attn_k": T.Q8_0,
    "attn_v": T.Q4_0,
    "attn_output": T.Q8_0,
    "ffn_gate": T.Q4_0,
    "ffn_up": T.Q4_1,
    "ffn_down": T.Q4_1,
}
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
# transformers reads no head size from a qwen3 GGUF (it keeps Qwen3's 128); qwen2's is hidden/heads.
HEAD_DIM = {"qwen2": 16, "qwen3": 128}
PROMPTS = [[104, 101, 108, 108, 111], [32, 119, 200, 7, 77, 13, 250]]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_tiny_gguf_greedy_matches_transformers(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(arch, str(path), TYPES, head_dim=HEAD_DIM[arch], **TINY)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    llm = LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory=4 << 20)
    assert llm.llm_engine.config.model.architecture == f"{arch.capitalize()}ForCausalLM"
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    for prompt, tokens in zip(PROMPTS, ours, strict=True):
        ids = torch.tensor([prompt])
        expected = hf.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert list(tokens) == expected[0, len(prompt) :].tolist()
