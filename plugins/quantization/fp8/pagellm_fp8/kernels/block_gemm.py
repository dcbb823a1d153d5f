"""The block-scaled FP8 GEMM of checkpoints quantized in 128x128 weight blocks (DeepSeek-V3's
``weight_block_size: [128, 128]``), with activations quantized per token and group of 128.

``out[m, n] = sum over K blocks k of a_scales[m, k] * b_scales[n // 128, k] *
(a[m, 128k:128k+128] . b[n, 128k:128k+128])``: each K step is one fp8 ``tl.dot`` (tensor cores on
Hopper and Ada), its float32 tile scaled by the row's and the weight block's scales before it is
added to the float32 accumulator. The K tile is the scale block (128), and an N tile never spans
two weight blocks, so every step needs one weight scale and one activation scale per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagellm.quantization.fp8_formats import FP8_FORMATS
from pagellm_fp8.kernels.checks import (
    Fp8KernelInputError,
    require_dtype,
    require_shape,
    rows_of,
)
from pagellm_fp8.kernels.quant import per_token_group_quant_fp8

__all__ = ["SCALE_BLOCK", "block_scaled_linear", "block_scaled_mm", "per_token_group_quant_fp8"]

SCALE_BLOCK = 128
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int  # divides SCALE_BLOCK
    group_m: int  # M tiles that walk the N tiles together (reuse of B tiles in L2)
    num_warps: int
    num_stages: int


def tile_config(m: int) -> TileConfig:
    """The tiles for ``m`` rows. Up to 64 rows the GEMM is bound by reading the weight: narrow N
    tiles give enough programs (128 for N = 4096 on 132 SMs) and deep pipelines keep loads in
    flight; from 256 rows it is bound by the tensor cores: large tiles, fewer B re-reads."""
    if m <= 16:
        return TileConfig(block_m=16, block_n=32, group_m=1, num_warps=4, num_stages=6)
    if m <= 64:
        return TileConfig(block_m=64, block_n=32, group_m=1, num_warps=4, num_stages=6)
    if m <= 256:
        return TileConfig(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=4)
    return TileConfig(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=3)


@triton.jit
def _block_scaled_mm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    a_scale_ptr,
    b_scale_ptr,
    M,
    N,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    stride_asm,
    stride_ask,
    stride_bsn,
    stride_bsk,
    K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tl.static_assert(SCALE_BLOCK % BLOCK_N == 0)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    programs_per_group = GROUP_M * num_pid_n
    first_m = (pid // programs_per_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % programs_per_group) % group_rows
    pid_n = (pid % programs_per_group) // group_rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows and columns past the edge load a valid row (wrapped) instead of a masked one, so the
    # loads stay unmasked; their results are never stored.
    load_rows = (rows % M).to(tl.int64)
    load_cols = (cols % N).to(tl.int64)
    rk = tl.arange(0, SCALE_BLOCK)
    a_ptrs = a_ptr + load_rows[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + load_cols[None, :] * stride_bn + rk[:, None] * stride_bk
    a_scale_ptrs = a_scale_ptr + load_rows * stride_asm
    b_scale_row = b_scale_ptr + ((pid_n * BLOCK_N) // SCALE_BLOCK) * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // SCALE_BLOCK):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        a_scale = tl.load(a_scale_ptrs + kb * stride_ask)
        b_scale = tl.load(b_scale_row + kb * stride_bsk)
        acc += tl.dot(a, b) * (a_scale[:, None] * b_scale)
        a_ptrs += SCALE_BLOCK * stride_ak
        b_ptrs += SCALE_BLOCK * stride_bk

    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def block_scaled_mm(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``a`` [M, K] float8 with ``a_scales`` [M, K // 128] float32 (per token and group of 128,
    from ``per_token_group_quant_fp8``) times ``b`` [N, K] float8 of the same format (a linear
    layer's weight; float8_e4m3fn, or float8_e4m3fnuz on AMD CDNA3) with ``b_scales``
    [ceil(N / 128), K // 128] float32 (per 128x128 block): ``[M, N]`` in ``out_dtype``. ``K``
    must be a multiple of 128; ``N`` and ``M`` need not."""
    require_dtype("a", a, FP8_FORMATS)
    require_dtype("b", b, (a.dtype,))
    require_dtype("a_scales", a_scales, (torch.float32,))
    require_dtype("b_scales", b_scales, (torch.float32,))
    if out_dtype not in OUT_DTYPES:
        raise Fp8KernelInputError(f"out_dtype {out_dtype} is not one of bfloat16, float16, float32")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise Fp8KernelInputError(
            f"a {tuple(a.shape)} and b {tuple(b.shape)} are not [M, K] and [N, K] with one K"
        )
    M, K = a.shape
    N = b.shape[0]
    if K % SCALE_BLOCK:
        raise Fp8KernelInputError(
            f"K = {K} is not a multiple of {SCALE_BLOCK}: the block-scaled GEMM takes weights "
            f"quantized in {SCALE_BLOCK}x{SCALE_BLOCK} blocks of a K that they divide"
        )
    require_shape("a_scales", a_scales, (M, K // SCALE_BLOCK))
    require_shape("b_scales", b_scales, (triton.cdiv(N, SCALE_BLOCK), K // SCALE_BLOCK))
    devices = {t.device for t in (a, a_scales, b, b_scales)}
    if len(devices) != 1:
        raise Fp8KernelInputError(
            f"the operands are on several devices: {sorted(map(str, devices))}"
        )
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    cfg = tile_config(M)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _block_scaled_mm_kernel[grid](
        a,
        b,
        c,
        a_scales,
        b_scales,
        M,
        N,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        c.stride(1),
        a_scales.stride(0),
        a_scales.stride(1),
        b_scales.stride(0),
        b_scales.stride(1),
        K=K,  # fixed per layer: one compilation each, a known trip count
        SCALE_BLOCK=SCALE_BLOCK,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return c


def block_scaled_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scales: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x`` [..., K] (bf16/fp16/fp32) through a 128x128-block FP8 linear layer (``weight``
    [N, K], ``weight_scales`` [ceil(N / 128), K // 128]): quantizes ``x`` per token and group
    of 128, then ``block_scaled_mm``; ``[..., N]`` in ``out_dtype`` (default: ``x``'s)."""
    x2 = rows_of("x", x)
    q, scales = per_token_group_quant_fp8(x2, SCALE_BLOCK, dtype=weight.dtype)
    out = block_scaled_mm(q, scales, weight, weight_scales, out_dtype or x.dtype)
    return out.view(*x.shape[:-1], weight.shape[0])
