"""The int4 weight dequantized to a dense [K, N] matrix (the prefill path: then a cuBLAS GEMM)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm_int4.kernel_layout import TILE_K
from pagellm_int4.kernels.inputs import check_weight
from pagellm_int4.kernels.unpack import codes_f32


@triton.jit
def _dequantize_kernel(
    qw_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    N,
    K,
    GROUP_SIZE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One interleaved tile of rows (BLOCK_K = TILE_K): one load of its words, eight slabs."""
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(0) * BLOCK_K
    n_mask = offs_n < N
    offs_r = k0 // 8 + offs_w
    words = tl.load(qw_ptr + offs_r[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)
    for i in tl.static_range(8):
        rows = k0 + (BLOCK_K // 8) * i + offs_w
        mask = (rows < K)[:, None] & n_mask[None, :]
        g_rows = (rows // GROUP_SIZE)[:, None] * N + offs_n[None, :]
        s = tl.load(s_ptr + g_rows, mask=mask, other=0.0)
        z = tl.load(z_ptr + g_rows, mask=mask, other=0).to(tl.float32)
        w = (codes_f32(words, i) - z) * s
        out = out_ptr + rows.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The weight [K, N] in ``dtype`` (kernel-order rows)."""
    n = check_weight(qweight, scales, zeros, in_features, group_size)
    out = torch.empty(in_features, n, dtype=dtype, device=qweight.device)
    block_k, block_n = TILE_K, 64
    grid = (triton.cdiv(in_features, block_k), triton.cdiv(n, block_n))
    _dequantize_kernel[grid](
        qweight,
        scales,
        zeros,
        out,
        n,
        in_features,
        GROUP_SIZE=group_size,
        BLOCK_K=block_k,
        BLOCK_N=block_n,
    )
    return out
