"""Reading a GGUF file's tensors with the `gguf` package, under HF names.

A linear layer's weight of a type the kernels read comes as its raw blocks (uint8 rows, one per
output feature) tagged with ``gguf_type`` when the GGUF quantization method runs the model;
everything else is dequantized to float (``gguf.quants.dequantize``), as on the CPU platform.

llama.cpp's converter permutes the rows of q/k projections of Llama-architecture models (its RoPE
pairs adjacent elements, HF's pairs the two halves); we undo that so the tensors fit HF's layout.
A row of blocks holds one output feature, so the raw blocks are permuted the same way.

Tensors are read when indexed (`tensor_slices.GGUFTensor`): under tensor parallelism each rank
reads and dequantizes only its rows or its blocks of columns.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pagellm_gguf.block_types import FLOAT_TYPES, KERNEL_TYPES, type_name
from pagellm_gguf.tensor_slices import GGUFTensor

logger = logging.getLogger(__name__)

# Architectures whose GGUF conversion permutes q/k rows.
_PERMUTED_QK_ARCHS = {"llama", "mistral"}
SUPPORTED_ARCHS = {"llama", "mistral", "qwen2", "qwen3"}

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
_LINEAR_PARTS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def field_value(reader: object, key: str) -> object:
    field = reader.fields[key]  # type: ignore[attr-defined]
    part = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(part).decode()
    return part.tolist()[0]


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _is_linear_weight(gguf_name: str) -> bool:
    m = _LAYER_RE.match(gguf_name)
    return bool(m and m.group(2) in _LINEAR_PARTS and m.group(3) == "weight")


@functools.lru_cache(maxsize=2)
def _open(path: str, size: int, mtime_ns: int) -> Any:
    import gguf

    return gguf.GGUFReader(path)


def open_gguf(path: str) -> Any:
    """The file's `gguf.GGUFReader`, kept for the next load of the same file in this process:
    parsing the metadata (the whole token table) takes seconds; the tensors stay memory-mapped."""
    stat = os.stat(path)
    return _open(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


def gguf_tensors(
    path: str, dtype: torch.dtype, keep_quantized: bool = False
) -> Iterator[tuple[str, GGUFTensor]]:
    """(HF name, tensor read when indexed) for each tensor of the file: float tensors in
    ``dtype``; with ``keep_quantized``, linear weights of the kernel types as raw blocks (uint8
    rows with attribute ``gguf_type``)."""
    reader = open_gguf(path)
    arch = str(field_value(reader, "general.architecture"))
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} in {path} is not supported; supported: {sorted(SUPPORTED_ARCHS)}."
        )
    num_heads = int(field_value(reader, f"{arch}.attention.head_count"))  # type: ignore[call-overload]
    num_kv_heads = int(field_value(reader, f"{arch}.attention.head_count_kv"))  # type: ignore[call-overload]
    dequantized: dict[str, int] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue  # e.g. rope frequency tables, recomputed here
        qtype = tensor.tensor_type
        raw = keep_quantized and qtype in KERNEL_TYPES and _is_linear_weight(tensor.name)
        if (
            keep_quantized
            and not raw
            and qtype not in FLOAT_TYPES
            and _is_linear_weight(tensor.name)
        ):
            dequantized[type_name(qtype)] = dequantized.get(type_name(qtype), 0) + 1
        heads = None
        if arch in _PERMUTED_QK_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = num_heads if "q_proj" in name else num_kv_heads
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        yield name, GGUFTensor(np.asarray(tensor.data), qtype, shape, dtype, raw, heads)
    for name, count in dequantized.items():
        logger.info(
            "GGUF: %d linear weights of type %s dequantized at load (no kernel reads %s blocks; "
            "kept quantized: %s)",
            count,
            name,
            name,
            ", ".join(type_name(t) for t in KERNEL_TYPES),
        )


def iterate_gguf_weights(
    path: str, dtype: torch.dtype, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """`gguf_tensors`, each read whole."""
    for name, tensor in gguf_tensors(path, dtype, keep_quantized):
        yield name, tensor[:]
