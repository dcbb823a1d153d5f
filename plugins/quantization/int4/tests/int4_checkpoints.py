"""Tiny random Llama checkpoints for the int4 tests, and an unpacker of each format written from
the formats' definitions, independent of pagellm_int4's packing code: what the tests check the
RTN writer's output with, and what builds the dense model of the same (dequantized) weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from pagellm_int4.scheme import Int4Scheme

# Dimensions that groups of 32, 64 and 128 divide; q is 256 rows, k and v 128 each.
TINY_INT4_LLAMA = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
AWQ_NIBBLE_COLUMNS = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of an AWQ word: column AWQ[i] of 8


def tiny_llama(directory: Path, tokenizer_dir: str) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_INT4_LLAMA)).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 1.0 if "embed_tokens" in name else 0.05)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    return directory


def nibbles(words: torch.Tensor) -> np.ndarray:
    """int32 words [..., W] -> [..., W, 8]: nibble i (bits 4i..4i+3) of each word."""
    w = words.numpy().astype(np.int64) & 0xFFFFFFFF
    return np.stack([(w >> (4 * i)) & 0xF for i in range(8)], axis=-1)


def gptq_unpack(tensors: dict[str, torch.Tensor], v1: bool) -> np.ndarray:
    """GPTQ: qweight [K/8, N], input row 8r + i in nibble i of word r; qzeros [G, N/8], output
    column 8c + i in nibble i; v1 stores zero - 1. Returns the float32 weight [N, K]."""
    qw, qz = tensors["qweight"], tensors["qzeros"]
    k8, n = qw.shape
    q = nibbles(qw).transpose(0, 2, 1).reshape(k8 * 8, n)  # [K, N]
    z = nibbles(qz).reshape(qz.shape[0], -1)[:, :n] + (1 if v1 else 0)  # [G, N]
    s = tensors["scales"].float().numpy()
    g = tensors["g_idx"].numpy()
    return ((q - z[g]) * s[g]).T.astype(np.float32)


def awq_unpack(tensors: dict[str, torch.Tensor], group_size: int) -> np.ndarray:
    """AWQ GEMM: qweight [K, N/8] and qzeros [G, N/8], output column 8c + AWQ[i] in nibble i."""

    def columns(words: torch.Tensor) -> np.ndarray:
        nib = nibbles(words)  # [R, W, 8]
        out = np.empty_like(nib)
        for i, col in enumerate(AWQ_NIBBLE_COLUMNS):
            out[:, :, col] = nib[:, :, i]
        return out.reshape(words.shape[0], -1)

    q, z = columns(tensors["qweight"]), columns(tensors["qzeros"])
    s = tensors["scales"].float().numpy()
    g = np.arange(q.shape[0]) // group_size
    return ((q - z[g]) * s[g]).T.astype(np.float32)


def dense_checkpoint(source: Path, quantized: Path, target: Path, unpack: object) -> Path:
    """The float checkpoint ``source`` with each quantized layer of ``quantized`` replaced by
    its dequantized weight (``unpack(layer tensors) -> [N, K]``): the same weights, dense."""
    from safetensors.torch import load_file, save_file

    dense = load_file(str(source / "model.safetensors"))
    packed = load_file(str(quantized / "model.safetensors"))
    layers = {n.rsplit(".", 1)[0] for n in packed if n.startswith("model.layers.") and "proj." in n}
    for layer in layers:
        local = {n.rsplit(".", 1)[1]: t for n, t in packed.items() if n.rsplit(".", 1)[0] == layer}
        dense[f"{layer}.weight"] = torch.from_numpy(np.ascontiguousarray(unpack(local)))  # type: ignore[operator]
    target.mkdir(parents=True, exist_ok=True)
    save_file(dense, str(target / "model.safetensors"))
    for path in source.iterdir():
        if path.suffix == ".json" or path.suffix == ".txt":
            shutil.copy(path, target / path.name)
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config))
    return target


def compressed_tensors_unpack(scheme: Int4Scheme):
    """compressed-tensors' own decompressor (its unpacker and dequantization) of ``scheme``'s
    layer tensors -> the float32 weight [N, K]."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(
        num_bits=4,
        type="int",
        symmetric=scheme.sym,
        strategy="channel" if scheme.group_size == -1 else "group",
        group_size=None if scheme.group_size == -1 else scheme.group_size,
    )
    ct_scheme = QuantizationScheme(targets=["Linear"], weights=args)

    def unpack(tensors):
        state = {k: v.float() if k == "weight_scale" else v for k, v in tensors.items()}
        out = PackedQuantizationCompressor.decompress(state, ct_scheme)
        return out["weight"].float().numpy()

    return unpack
