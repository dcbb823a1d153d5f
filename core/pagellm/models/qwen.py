"""Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm on each head of q and k) on the Llama decoder."""

from __future__ import annotations

from pagellm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
