"""W4A16 on Triton, from the kernel layout (``pagellm_int4.kernel_layout``): int32 [ceil(K/8), N]
words of eight input rows, float32 scales and uint8 zeros [G, N], contiguous groups.

- `w4a16_gemm` (decode): each program loads an activation tile [BLOCK_M, BLOCK_K], the words of
  its weight tile, unpacks and dequantizes them in registers (float32 ``(q - z) * s``, rounded
  once to the activation dtype), and ``tl.dot``s them into a float32 accumulator; the output is
  written in the activation dtype. Weight bytes are read once per M tile: at decode sizes (one
  M tile) the GEMM reads a quarter of the bf16 weight's bytes. Small M splits K over several
  programs (`tile_config`), whose float32 partial sums a second kernel adds in a fixed order.
- `dequantize_int4` (prefill): the whole weight [K, N] in the activation dtype, for a cuBLAS GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["dequantize_int4", "tile_config", "w4a16_gemm"]

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Int4KernelInputError(ValueError):
    """A tensor given to an int4 kernel has a dtype or shape the kernel does not take."""


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    scales_per_tile: bool
    """Every K tile lies in one group (block_k divides the group, or one group spans K): one
    scale and zero row per tile instead of one per input row."""
    split_k: int
    """Programs sharing one output tile, each over its own K range; their float32 partial sums
    are added in a fixed order by a second kernel (deterministic, unlike atomics)."""
    num_warps: int
    num_stages: int


SPLIT_K_MAX_M = 16
"""Split-K only up to this M: its float32 workspace (split_k x M x N) stays small next to the
weight it helps stream."""


def tile_config(m: int, n: int, k: int, group_size: int, num_sms: int) -> TileConfig:
    """Narrow N tiles give N / 32 programs (128 for N = 4096); at decode sizes K is split until
    there are about four programs per SM (``num_sms``) to keep enough weight reads in flight,
    as long as each program keeps at least four K tiles."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 32
    one_group = group_size >= k
    block_k, per_tile = 32, False
    for candidate in (128, 64, 32, 16):
        if one_group or group_size % candidate == 0:
            block_k, per_tile = candidate, True
            break
    programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    while (
        m <= SPLIT_K_MAX_M and programs * split * 2 <= 4 * num_sms and k >= split * 2 * 4 * block_k
    ):
        split *= 2
    return TileConfig(block_m, block_n, block_k, per_tile, split, 4, 4)


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    stride_xk,
    stride_qk,
    stride_om,
    stride_os,
    K: tl.constexpr,
    K_TILES_PER_SPLIT: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALES_PER_TILE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # Nibble i of a word is input row 8r + i: words [BLOCK_K / 8, BLOCK_N] are loaded once and
    # unpacked into [BLOCK_K, BLOCK_N] by a reshape that keeps (r, i) -> 8r + i.
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(K_TILES_PER_SPLIT):
        k0 = (pid_s * K_TILES_PER_SPLIT + t) * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        offs_r = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(
            qw_ptr + offs_r[:, None] * stride_qk + offs_n[None, :],
            mask=(offs_r < (K + 7) // 8)[:, None] & n_mask[None, :],
            other=0,
        )
        nibbles = (words[:, None, :] >> shifts[None, :, None]) & 0xF
        q = tl.reshape(nibbles, (BLOCK_K, BLOCK_N)).to(tl.float32)
        if SCALES_PER_TILE:
            g = k0 // GROUP_SIZE
            s = tl.load(s_ptr + g * N + offs_n, mask=n_mask & (k0 < K), other=0.0)
            z = tl.load(z_ptr + g * N + offs_n, mask=n_mask & (k0 < K), other=0).to(tl.float32)
            w = (q - z[None, :]) * s[None, :]
        else:
            wk_mask = k_mask[:, None] & n_mask[None, :]
            g_rows = (offs_k // GROUP_SIZE)[:, None] * N + offs_n[None, :]
            s2 = tl.load(s_ptr + g_rows, mask=wk_mask, other=0.0)
            z2 = tl.load(z_ptr + g_rows, mask=wk_mask, other=0).to(tl.float32)
            w = (q - z2) * s2
        acc += tl.dot(a, w.to(a.dtype))
    tl.store(
        out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


@triton.jit
def _sum_splits_kernel(ws_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        total += tl.load(ws_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


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
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_k < K)[:, None] & (offs_n < N)[None, :]
    words = tl.load(qw_ptr + (offs_k[:, None] // 8) * N + offs_n[None, :], mask=mask, other=0)
    q = ((words >> ((offs_k[:, None] % 8) * 4)) & 0xF).to(tl.float32)
    g_rows = (offs_k // GROUP_SIZE)[:, None] * N + offs_n[None, :]
    s = tl.load(s_ptr + g_rows, mask=mask, other=0.0)
    z = tl.load(z_ptr + g_rows, mask=mask, other=0).to(tl.float32)
    w = (q - z) * s
    tl.store(
        out_ptr + offs_k[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty), mask=mask
    )


def _check_weight(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int, group_size: int
) -> int:
    n = qweight.shape[1]
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != (triton.cdiv(k, 8), n):
        raise Int4KernelInputError(
            f"qweight has dtype {qweight.dtype} and shape {tuple(qweight.shape)}; expected "
            f"int32 [{triton.cdiv(k, 8)}, {n}] for K = {k}"
        )
    groups = triton.cdiv(k, group_size)
    if scales.dtype != torch.float32 or tuple(scales.shape) != (groups, n):
        raise Int4KernelInputError(
            f"scales has dtype {scales.dtype} and shape {tuple(scales.shape)}; expected "
            f"float32 [{groups}, {n}]"
        )
    if zeros.dtype != torch.uint8 or tuple(zeros.shape) != (groups, n):
        raise Int4KernelInputError(
            f"zeros has dtype {zeros.dtype} and shape {tuple(zeros.shape)}; expected "
            f"uint8 [{groups}, {n}]"
        )
    if not (qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()):
        raise Int4KernelInputError("qweight, scales and zeros must be contiguous")
    return n


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs one program after another
    return torch.cuda.get_device_properties(device).multi_processor_count


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    split_k: int | None = None,
) -> torch.Tensor:
    """``x`` [M, K] (bf16, fp16; fp32 in the interpreter) times the int4 weight: [M, N] in x's
    dtype. ``split_k`` overrides the tile heuristic's (tests)."""
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES:
        raise Int4KernelInputError(
            f"x has shape {tuple(x.shape)} and dtype {x.dtype}; expected [M, K] bf16/fp16/fp32"
        )
    m, k = x.shape
    n = _check_weight(qweight, scales, zeros, k, group_size)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = tile_config(m, n, k, group_size, _num_sms(x.device))
    splits = split_k or cfg.split_k
    k_tiles = triton.cdiv(triton.cdiv(k, cfg.block_k), splits)
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)
    _w4a16_gemm_kernel[grid](
        x,
        qweight,
        scales,
        zeros,
        target,
        m,
        n,
        x.stride(0),
        x.stride(1),
        qweight.stride(0),
        n,
        m * n,
        K=k,
        K_TILES_PER_SPLIT=k_tiles,
        GROUP_SIZE=group_size,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SCALES_PER_TILE=cfg.scales_per_tile,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            target, out, m * n, SPLIT_K=splits, BLOCK=block
        )
    return out


def dequantize_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The weight [K, N] in ``dtype`` (kernel-order rows)."""
    n = _check_weight(qweight, scales, zeros, in_features, group_size)
    out = torch.empty(in_features, n, dtype=dtype, device=qweight.device)
    block_k, block_n = 32, 128
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
