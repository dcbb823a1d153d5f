"""GGUF linear ops on planes (``planes.py``), choosing the kernel path by the number of rows M."""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch
import triton
from triton.runtime.errors import OutOfResources

from pagellm_gguf.kernels import plane_dequantize_kernel, plane_matmul_kernel
from pagellm_gguf.planes import GGUFPlanes

logger = logging.getLogger(__name__)

DECODE_MAX_M = 32
"""Up to this many rows the decode matmul reads the packed weights once; above it the weights
are dequantized to the activations' dtype and multiplied by cuBLAS, whose tensor-core GEMM wins
once the product, not the weight read, is the cost."""


class DecodeTiles(NamedTuple):
    """A launch of ``plane_matmul_kernel``: tile sizes, K splits, Triton's warps/stages, and
    whether the slabs go through ``tl.dot`` (else per-thread float32 FMAs, block_m 1)."""

    block_m: int
    block_n: int
    block_k: int
    splits: int
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: one program at a time anyway
    return torch.cuda.get_device_properties(device).multi_processor_count


def k_splits(n_tiles: int, k_tiles: int, num_sms: int) -> int:
    """How many runs of K to give separate programs: enough for about four programs per SM
    (with 64-column tiles, N = 4096 has 64 output tiles for 132 SMs), each run at least two
    K tiles (a run's loads are then pipelined)."""
    wanted = max(1, (4 * num_sms) // max(n_tiles, 1))
    return max(1, min(wanted, k_tiles // 2))


def decode_tiles(m: int, n: int, k: int, code_bits: int, num_sms: int) -> DecodeTiles:
    """The default launch for x [m, k] @ W^T, W [n, k] with ``code_bits``-bit codes.

    - M = 1: no tl.dot (``dot=False``, block_m 1): compiled for sm_90 the per-thread FMAs run
      about a tenth fewer instructions per weight than tl.dot's 16-row tile padded from one
      row, and no barrier per slab (the decode matmul is bound by those instructions more
      than by memory: about 7 per weight). The sweep times both.
    - block_m: 16, tl.dot's smallest tile, up to 16 rows; 32 above (DECODE_MAX_M): one M tile,
      so the weights are read once.
    - block_k and block_n, as the H200 sweep (``benchmarks/gguf_gemm.py --sweep``) found them:
      with tl.dot, 128 columns by 128 input rows of 4-bit codes (64 of int8), about 1.5x
      faster at M = 16 than 64 by 256 / 128 (16 rows per slab: shorter word tiles, more of
      them in flight); without, 64 columns by 256 rows (128 of other widths), 32 columns for
      the widest matmuls (N >= 16,384, e.g. gate_up: 896 programs with no K split instead of
      448 in two, 15 % faster).
    - splits: about four programs per SM (`k_splits`).
    """
    dot = m > 1
    block_m = (16 if m <= 16 else 32) if dot else 1
    if dot:
        block_n, block_k = 128, 64 if code_bits == 8 else 128
    else:
        block_n, block_k = (32 if n >= 16384 else 64), 256 if code_bits == 4 else 128
    n_tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    splits = k_splits(n_tiles, triton.cdiv(k, block_k), num_sms)
    return DecodeTiles(block_m, block_n, block_k, splits, dot=dot)


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _check_tiles(tiles: DecodeTiles, per_word: int) -> None:
    least = 16 if tiles.dot else 1  # tl.dot's smallest sizes
    if not (
        _is_pow2(tiles.block_m)
        and _is_pow2(tiles.block_n)
        and _is_pow2(tiles.block_k)
        and (tiles.block_m >= 16 if tiles.dot else tiles.block_m == 1)
        and tiles.block_n >= 16
        and tiles.block_k >= 32
        and tiles.block_k // per_word >= least
        and tiles.splits >= 1
    ):
        raise ValueError(
            f"decode tiles {tiles} must be powers of two with block_n >= 16, block_k >= 32, "
            f"and with tl.dot block_m >= 16 and block_k / {per_word} codes per word >= 16 "
            "(tl.dot's inner size), without it block_m 1."
        )


def _layout_args(planes: GGUFPlanes) -> dict[str, int | bool]:
    layout = planes.layout
    return {
        "CODE_BITS": layout.code_bits,
        "SIGNED": layout.signed,
        "HIGH_BITS": layout.high_bits,
        "GROUP": layout.group,
        "OFFSET": layout.offset,
        "HAS_BIAS": layout.has_bias,
    }


def _pointers(planes: GGUFPlanes) -> tuple[torch.Tensor, ...]:
    # Stand-ins (the codes) for the planes a type lacks: the kernels never read them.
    high = planes.high if planes.high is not None else planes.codes
    bias = planes.bias if planes.bias is not None else planes.scale
    return planes.codes, high, planes.scale, bias


def dequantize_t(planes: GGUFPlanes, dtype: torch.dtype) -> torch.Tensor:
    """W^T [in_features, out_features] of ``planes`` in ``dtype`` (the prefill GEMM's input)."""
    n, k = planes.out_features, planes.in_features
    out = torch.empty(k, n, dtype=dtype, device=planes.codes.device)
    block_n, block_k = 128, 32 * planes.layout.per_word  # 32-row slabs
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    plane_dequantize_kernel[grid](
        *_pointers(planes), out, n, k, **_layout_args(planes), BLOCK_N=block_n, BLOCK_K=block_k
    )
    return out


def dequantize(planes: GGUFPlanes, dtype: torch.dtype) -> torch.Tensor:
    """The [out_features, in_features] weights of ``planes`` in ``dtype`` (a transposed view)."""
    return dequantize_t(planes, dtype).t()


def planes_matmul(
    x: torch.Tensor, planes: GGUFPlanes, tiles: DecodeTiles | None = None
) -> torch.Tensor:
    """x [M, K] @ W^T with W's tiles decoded in registers (the decode path). ``tiles``
    overrides the launch (``decode_tiles``' choice by default), for the benchmark's sweep."""
    m, k = x.shape
    n = planes.out_features
    if k != planes.in_features or x.stride(1) != 1:
        raise ValueError(
            f"x must be rows of {planes.in_features} contiguous columns, got shape "
            f"{tuple(x.shape)}, strides {x.stride()}."
        )
    if tiles is None:
        tiles = decode_tiles(m, n, k, planes.layout.code_bits, _num_sms(x.device))
    _check_tiles(tiles, planes.layout.per_word)
    k_split = triton.cdiv(triton.cdiv(k, tiles.block_k), tiles.splits) * tiles.block_k
    splits = triton.cdiv(k, k_split)
    if splits == 1:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:  # float32 partial sums, added below in a fixed order (graph replay equals eager)
        y = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    try:
        _launch_matmul(x, planes, y, tiles, k_split, splits)
    except OutOfResources as exc:
        # Tiles too large for this GPU's shared memory (the wider planes of Q5_K / Q6_K, or a
        # smaller GPU): 64 columns, two stages, with a warning once.
        fallback = tiles._replace(block_n=64, num_warps=4, num_stages=2)
        _warn_fallback(tiles, fallback, str(exc))
        _launch_matmul(x, planes, y, fallback, k_split, splits)
    return y if splits == 1 else y.sum(0).to(x.dtype)


@functools.cache
def _warn_fallback(tiles: DecodeTiles, fallback: DecodeTiles, reason: str) -> None:
    logger.warning(
        "GGUF decode tiles %s do not fit this GPU (%s); using %s", tiles, reason, fallback
    )


def _launch_matmul(
    x: torch.Tensor,
    planes: GGUFPlanes,
    y: torch.Tensor,
    tiles: DecodeTiles,
    k_split: int,
    splits: int,
) -> None:
    m, k = x.shape
    n = planes.out_features
    grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(m, tiles.block_m), splits)
    plane_matmul_kernel[grid](
        x,
        *_pointers(planes),
        y,
        m,
        n,
        x.stride(0),
        n,
        m * n,
        K=k,
        K_SPLIT=k_split,
        **_layout_args(planes),
        IEEE=x.dtype == torch.float32,
        USE_DOT=tiles.dot,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def gguf_linear(x: torch.Tensor, planes: GGUFPlanes) -> torch.Tensor:
    """x [..., K] @ W^T for W stored as GGUF planes."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    if flat.shape[0] <= DECODE_MAX_M:
        y = planes_matmul(flat, planes)
    else:
        y = flat @ dequantize_t(planes, flat.dtype)
    return y.reshape(*x.shape[:-1], planes.out_features)
