"""GGUF linear ops on raw blocks, choosing the kernel path by the number of rows M."""

from __future__ import annotations

import functools

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


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: one program at a time anyway
    return torch.cuda.get_device_properties(device).multi_processor_count


def k_splits(n_tiles: int, k_tiles: int, num_sms: int) -> int:
    """How many runs of K to give separate programs: enough programs for about four per SM
    (a decode matmul has few output tiles: 128 for N = 4096), each run at least four tiles."""
    wanted = max(1, (4 * num_sms) // max(n_tiles, 1))
    return max(1, min(wanted, k_tiles // 4))


def dequant_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """x [M, K] @ W^T with W's tiles decoded in registers (the decode path)."""
    m, k = x.shape
    row_bytes = _check(blocks, qtype, k)
    n = blocks.shape[0]
    block_m, block_n, block_k = 16, 32, 128
    n_tiles, m_tiles, k_tiles = (
        triton.cdiv(n, block_n),
        triton.cdiv(m, block_m),
        triton.cdiv(k, block_k),
    )
    splits = k_splits(n_tiles * m_tiles, k_tiles, _num_sms(x.device))
    k_split = triton.cdiv(k_tiles, splits) * block_k
    splits = triton.cdiv(k, k_split)
    if splits == 1:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        y = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    dequant_matmul_kernel[(n_tiles, m_tiles, splits)](
        x,
        blocks,
        y,
        m,
        n,
        row_bytes,
        x.stride(0),
        n,
        m * n,
        K=k,
        K_SPLIT=k_split,
        QTYPE=qtype,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return y if splits == 1 else y.sum(0).to(x.dtype)


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """x [..., K] @ W^T for W stored as raw GGUF rows of type ``qtype``."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    if flat.shape[0] <= DECODE_MAX_M:
        y = dequant_matmul(flat, blocks, qtype)
    else:
        y = flat @ dequantize(blocks, qtype, flat.shape[1], flat.dtype).t()
    return y.reshape(*x.shape[:-1], blocks.shape[0])
