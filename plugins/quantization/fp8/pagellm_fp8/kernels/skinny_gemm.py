"""A GEMM for decode-sized batches (M up to 256 tokens) with the weight as the MMA's M side:
``out [M, N] = (x [M, K] @ w [N, K].T) * x_scale * w_scale``, float8 (per-tensor scales) or
16-bit operands (no scales), float32 accumulation. Opt-in: per-tensor layers use it with
``PAGELLM_FP8_SKINNY_GEMM=1`` (`pagellm_fp8.gemm`).

Why: at W1's decode (200 tokens) ``torch._scaled_mm`` read the weights of Llama-3.1-8B's qkv
(25 MB of float8) in 17 us on an H200, 1.5 TB/s, and o's in 14 us (1.2 TB/s): cuBLAS's tiles
give those narrow matmuls 48 to 96 programs on 132 SMs. Here a program owns ``BLOCK_N`` weight
rows (64 or 128: the warpgroup MMA's M) for every token of its ``BLOCK_M`` (the MMA's N, 16 to
256), so a weight row is read from HBM once and the grid has ``N / BLOCK_N`` programs per token
tile. Both operands are K-contiguous, as FP8 warpgroup MMAs need them. Rows and tokens past the
edge are masked per row (the mask is constant along K, so the loads stay 16-byte vectors), and
a token tile's padding is not read at all: at these sizes an SM's intake from L2 (about
(BLOCK_N + tokens) x K bytes a program: the activations are read again by every program) bounds
the time as much as HBM does. ``split_k`` > 1 gives each program a slice of K, for more programs
than weight tiles: the slices add up, scaled, into a zeroed float32 output by atomics, converted
to ``out_dtype`` after (two more launches).

`benchmarks/fp8_gemm.py` times it next to ``torch._scaled_mm`` (schemes ``*_skinny``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagellm_fp8.kernels.checks import Fp8KernelInputError

MAX_M = 256
"""The largest batch (tokens) of one tile: the warpgroup MMA's N."""
OPERAND_DTYPES = (torch.float8_e4m3fn, torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class SkinnyTiles:
    block_n: int  # weight rows a program
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs along K (each K / split_k, a multiple of block_k)


def skinny_tiles(n: int, k: int, element_size: int) -> SkinnyTiles:
    """Untuned defaults (`benchmarks/fp8_gemm.py --skinny-sweep` times the others): 128-byte
    rows of K a stage, 64 weight rows a program, one warpgroup."""
    return SkinnyTiles(block_n=64, block_k=128 // element_size, num_warps=4, num_stages=4)


@triton.jit
def _skinny_gemm_kernel(
    w_ptr,
    x_ptr,
    out_ptr,
    x_scale_ptr,
    w_scale_ptr,
    M,
    N,
    stride_w,
    stride_x,
    stride_out,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SCALED: tl.constexpr,
):
    K_SLICE: tl.constexpr = K // SPLIT_K
    tl.static_assert(K_SLICE * SPLIT_K == K and K_SLICE % BLOCK_K == 0)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    first = tl.program_id(2) * K_SLICE
    ks = first + tl.arange(0, BLOCK_K)
    row_ok = (rows < N)[:, None]
    token_ok = (tokens < M)[:, None]
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_w + ks[None, :]
    x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * stride_x + ks[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(0, K_SLICE // BLOCK_K):
        w = tl.load(w_ptrs, mask=row_ok, other=0.0)
        x = tl.load(x_ptrs, mask=token_ok, other=0.0)
        if SCALED:
            # Hopper's FP8 MMAs add into the accumulator with fewer bits than float32, and
            # Triton lets them run through all of K unless told (its sm_90 default): one
            # promotion into float32 a K tile, as cuBLAS does without fast accumulation.
            acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if SCALED:
        acc = acc * (tl.load(x_scale_ptr) * tl.load(w_scale_ptr))
    out_ptrs = out_ptr + tokens.to(tl.int64)[None, :] * stride_out + rows[:, None]
    mask = (rows < N)[:, None] & (tokens < M)[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")


def skinny_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    tiles: SkinnyTiles | None = None,
) -> torch.Tensor:
    """``x`` [M, K] (M <= ``MAX_M``) times ``w`` [N, K].T, both float8_e4m3fn with one-element
    float32 scales, or both bfloat16 / float16 without: ``[M, N]`` of ``out_dtype``. K must be a
    multiple of the tile's ``block_k`` (128 bytes of a row)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise Fp8KernelInputError(
            f"x {tuple(x.shape)} and w {tuple(w.shape)} are not [M, K] and [N, K]"
        )
    if x.dtype != w.dtype or x.dtype not in OPERAND_DTYPES:
        raise Fp8KernelInputError(
            f"x is {x.dtype} and w {w.dtype}: both float8_e4m3fn, bfloat16 or float16"
        )
    scaled = x.dtype == torch.float8_e4m3fn
    if scaled != (x_scale is not None and w_scale is not None):
        raise Fp8KernelInputError("float8 operands take both scales, 16-bit ones neither")
    for name, s in (("x_scale", x_scale), ("w_scale", w_scale)):
        if s is not None and (s.dtype != torch.float32 or s.numel() != 1):
            raise Fp8KernelInputError(f"{name} must be one float32 value (a per-tensor scale)")
    if out_dtype not in OUT_DTYPES:
        raise Fp8KernelInputError(f"out_dtype {out_dtype} is not one of {OUT_DTYPES}")
    M, K = x.shape
    N = w.shape[0]
    if M > MAX_M:
        raise Fp8KernelInputError(f"x has {M} rows; this GEMM takes at most {MAX_M}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise Fp8KernelInputError("x and w must be contiguous along K")
    tiles = tiles or skinny_tiles(N, K, x.element_size())
    if tiles.split_k < 1 or K % (tiles.block_k * tiles.split_k):
        raise Fp8KernelInputError(
            f"K {K} is not a multiple of the tile's {tiles.block_k} x split_k {tiles.split_k}"
        )
    if M == 0 or N == 0:
        return torch.empty((M, N), dtype=out_dtype, device=x.device)
    split = tiles.split_k > 1
    out = (
        torch.zeros((M, N), dtype=torch.float32, device=x.device)
        if split
        else torch.empty((M, N), dtype=out_dtype, device=x.device)
    )
    block_m = max(16, triton.next_power_of_2(M))
    dummy = out  # never read without SCALED
    grid = (triton.cdiv(N, tiles.block_n), triton.cdiv(M, block_m), tiles.split_k)
    _skinny_gemm_kernel[grid](
        w,
        x,
        out,
        x_scale if scaled else dummy,
        w_scale if scaled else dummy,
        M,
        N,
        w.stride(0),
        x.stride(0),
        out.stride(0),
        K=K,
        BLOCK_N=tiles.block_n,
        BLOCK_M=block_m,
        BLOCK_K=tiles.block_k,
        SPLIT_K=tiles.split_k,
        SCALED=scaled,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out.to(out_dtype) if split else out
