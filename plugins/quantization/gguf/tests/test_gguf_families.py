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
# Every kernel type, and fused layers mixing them (qkv: Q4_K, Q4_K, Q6_K; gate_up: Q4_0, Q8_0).
EVERY_TYPE = {
    "attn_q": T.Q4_K,
    "attn_k": T.Q4_K,
    "attn_v": T.Q6_K,
    "attn_output": T.Q5_K,
    "ffn_gate": T.Q4_0,
    "ffn_up": T.Q8_0,
    "ffn_down": T.Q4_1,
}
WIDE = {**TINY, "hidden_size": 256, "intermediate_size": 512}  # whole 256-weight super-blocks


def write_every_type_qwen3(path: str) -> None:
    write_tiny_gguf("qwen3", path, EVERY_TYPE, head_dim=HEAD_DIM["qwen3"], **WIDE)


def greedy_matches_transformers(path, device: str = "cpu") -> LLM:
    """Serve the GGUF at ``path`` and check its greedy tokens against transformers'."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    llm = LLM(str(path), dtype="float32", max_model_len=64, kv_cache_memory=4 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    for prompt, tokens in zip(PROMPTS, ours, strict=True):
        ids = torch.tensor([prompt])
        expected = hf.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert list(tokens) == expected[0, len(prompt) :].tolist(), (device, prompt)
    return llm


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_tiny_gguf_greedy_matches_transformers(arch, tmp_path):
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(arch, str(path), TYPES, head_dim=HEAD_DIM[arch], **TINY)
    llm = greedy_matches_transformers(path)
    assert llm.llm_engine.config.model.architecture == f"{arch.capitalize()}ForCausalLM"


def test_every_kernel_type_dequantized_at_load_matches_transformers(tmp_path):
    path = tmp_path / "qwen3-every-type.gguf"
    write_every_type_qwen3(str(path))
    llm = greedy_matches_transformers(path)
    assert llm.llm_engine.config.quantization is None  # the CPU: dequantized at load
