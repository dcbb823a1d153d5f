"""GGUF linear ops on raw blocks, choosing the kernel path by the number of rows M."""

from __future__ import annotations

import torch
import triton

from pagellm_gguf.block_types import block_shape
from pagellm_gguf.kernels import dequant_matmul_kernel, dequantize_kernel

DECODE_MAX_M = 32
"""Up to this many rows the dequantizing matmul reads the packed weights once; above it the
weights are dequantized to the activations' dtype and multiplied by cuBLAS, whose tensor-core
GEMM wins once the product, not the weight read, is the cost."""


def _check(blocks: torch.Tensor, qtype: int, in_features: int) -> int:
    block_size, type_size = block_shape(qtype)
    if in_features % block_size:
        raise ValueError(
            f"in_features={in_features} is not a whole number of {block_size}-weight blocks."
        )
    row_bytes = in_features // block_size * type_size
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes:
        raise ValueError(
            f"GGUF blocks must be uint8 rows of {row_bytes} bytes, got {blocks.dtype} {tuple(blocks.shape)}."
        )
    return row_bytes


def dequantize(
    blocks: torch.Tensor, qtype: int, in_features: int, dtype: torch.dtype
) -> torch.Tensor:
    """The [rows, in_features] weights of raw GGUF rows ``blocks`` of type ``qtype``, in ``dtype``."""
    row_bytes = _check(blocks, qtype, in_features)
    n = blocks.shape[0]
    out = torch.empty(n, in_features, dtype=dtype, device=blocks.device)
    block_n, block_k = 16, 256
    grid = (triton.cdiv(n, block_n), triton.cdiv(in_features, block_k))
    dequantize_kernel[grid](
        blocks, out, n, in_features, row_bytes, QTYPE=qtype, BLOCK_N=block_n, BLOCK_K=block_k
    )
    return out


def dequant_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """x [M, K] @ W^T with W's tiles decoded in registers (the decode path)."""
    m, k = x.shape
    row_bytes = _check(blocks, qtype, k)
    n = blocks.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = 16, 32, 128
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    dequant_matmul_kernel[grid](
        x,
        blocks,
        y,
        m,
        n,
        k,
        row_bytes,
        x.stride(0),
        y.stride(0),
        QTYPE=qtype,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return y


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """x [..., K] @ W^T for W stored as raw GGUF rows of type ``qtype``."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    if flat.shape[0] <= DECODE_MAX_M:
        y = dequant_matmul(flat, blocks, qtype)
    else:
        y = flat @ dequantize(blocks, qtype, flat.shape[1], flat.dtype).t()
    return y.reshape(*x.shape[:-1], blocks.shape[0])
