"""Writing GGUF files for the tests: random blocks of each type, and tiny models written with the
`gguf` package's own GGUFWriter from a random HF model (the name mapping is llama.cpp's)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize
from pagellm_gguf.block_types import block_shape

# Offsets of the float16 fields of each block (d, and dmin/m where the type has one).
_F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(
    qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0, scale: float = 0.1
) -> np.ndarray:
    """Random GGUF rows of type ``qtype`` (every quant bit pattern possible), with finite
    float16 scales in [-scale, scale]: uint8 [rows, bytes per row]."""
    block_size, type_size = block_shape(qtype)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    for at in _F16_FIELDS[qtype.name]:
        scales = rng.uniform(-scale, scale, size=(rows, cols // block_size, 1)).astype(np.float16)
        raw[..., at : at + 2] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


def _byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: one token per byte, so any text encodes."""
    visible = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in visible:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


MERGED = ("ĠĠ", "ĊĊ")  # two spaces, two newlines: the results of the vocabulary's merges
VOCAB_SIZE = 256 + len(MERGED)

_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_tiny_gguf(
    arch: str, path: str, types: dict[str, GGMLQuantizationType], **config: Any
) -> None:
    """A tiny random ``arch`` (qwen2, qwen3) model written as a GGUF file: linear weights in
    ``types`` (by GGUF part name, e.g. ``ffn_down``; others F32), a byte-level vocabulary of 256
    tokens and two merges. The `gguf` package quantizes to Q4_0, Q4_1 and Q8_0 but not to the K-quants: a
    K-quant weight is random blocks of its type instead (small scales), the same in both readers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(
        arch, vocab_size=VOCAB_SIZE, tie_word_embeddings=True, **config
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config).float()
    writer = GGUFWriter(path, arch)
    writer.add_block_count(hf_config.num_hidden_layers)
    writer.add_context_length(hf_config.max_position_embeddings)
    writer.add_embedding_length(hf_config.hidden_size)
    writer.add_feed_forward_length(hf_config.intermediate_size)
    writer.add_head_count(hf_config.num_attention_heads)
    writer.add_head_count_kv(hf_config.num_key_value_heads)
    head_dim = (
        getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads
    )
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(hf_config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(hf_config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    # Two merges (spaces, newlines) and their results: transformers up to 5.17 reads a
    # one-element GGUF array as its element, so a single merge would reach its tokenizer
    # converter as a string, split character by character into malformed merges.
    writer.add_token_list([*_byte_tokens(), *MERGED])
    writer.add_token_types([1] * VOCAB_SIZE)
    writer.add_token_merges([f"{t[0]} {t[1:]}" for t in MERGED])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    for name, tensor in model.state_dict().items():
        array = tensor.numpy().astype(np.float32)
        if name == "lm_head.weight":
            continue  # tied
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"
        part = gguf_name.split(".")[-2]
        qtype = (
            types.get(part) if gguf_name.startswith("blk.") and name.endswith("weight") else None
        )
        if qtype is None:
            writer.add_tensor(gguf_name, array)
        elif qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
            rows, cols = array.shape
            blocks = random_blocks(qtype, rows, cols, seed=rows + cols, scale=2e-3)
            writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
