"""Reading GGUF files with the `gguf` package: tensors dequantized to float at load, under HF names.

llama.cpp's converter permutes the rows of q/k projections of Llama-architecture models (its RoPE
pairs adjacent elements, HF's pairs the two halves); we undo that so the tensors fit HF's layout.
Model config and tokenizer come from the same file, through transformers' GGUF support.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

# Architectures whose GGUF conversion permutes q/k rows.
_PERMUTED_QK_ARCHS = {"llama", "mistral"}
_SUPPORTED_ARCHS = {"llama", "mistral", "qwen2", "qwen3"}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def _field_value(reader: object, key: str) -> object:
    field = reader.fields[key]  # type: ignore[attr-defined]
    part = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(part).decode()
    return part.tolist()[0]


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def iterate_gguf_weights(path: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    reader = gguf.GGUFReader(path)
    arch = str(_field_value(reader, "general.architecture"))
    if arch not in _SUPPORTED_ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} in {path} is not supported; supported: {sorted(_SUPPORTED_ARCHS)}."
        )
    num_heads = int(_field_value(reader, f"{arch}.attention.head_count"))  # type: ignore[call-overload]
    num_kv_heads = int(_field_value(reader, f"{arch}.attention.head_count_kv"))  # type: ignore[call-overload]
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue  # e.g. rope frequency tables, recomputed here
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if arch in _PERMUTED_QK_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = num_heads if "q_proj" in name else num_kv_heads
            array = _unpermute(array, heads)
        yield name, torch.from_numpy(np.array(array, dtype=np.float32, order="C")).to(dtype)
