"""Launch parameters of the attention kernels: tile shapes per dtype and head size, dot precision,
and the stride every kernel assumes of its tensors."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

# float8_e4m3fn's largest finite value: FP8 cache writes saturate there (e4m3fn has no infinity).
FP8_E4M3_MAX: tl.constexpr = tl.constexpr(448.0)


def is_fp8_cache(cache: torch.Tensor) -> bool:
    """The cache holds float8_e4m3fn entries (with per-layer scales), not the model dtype."""
    return cache.dtype == torch.float8_e4m3fn


def fp8_as_f16(query: torch.Tensor, cache: torch.Tensor) -> bool:
    """A bfloat16 query over an FP8 cache: the kernels compute in float16 instead. e4m3 converts
    to float16 in one instruction per pair of values (to bfloat16 it takes a detour through
    float32), both exactly; the query's bfloat16 values are float16 values too (for any magnitude
    below 65,504, subnormals aside), and the softmax weights lie in [0, 1]."""
    return is_fp8_cache(cache) and query.dtype == torch.bfloat16


def check_inner_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(
                f"expected the last dimension to be contiguous, got strides {t.stride()}"
            )


def dot_precision(dtype: torch.dtype) -> str:
    # float32 models expect float32 attention, not TF32's 10-bit mantissa.
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class Tiles:
    """Launch shape of an attention kernel. Untuned defaults for Hopper (H100/H200), checked
    by compiling for sm_90: no register spills, shared memory well under the 227 KiB limit."""

    block_n: int
    """Keys per tile."""
    num_warps: int
    num_stages: int
    block_q: int = 1
    """Query tokens per program (`paged_attention`)."""
    block_m: int = 16
    """Rows per program: query tokens x the query heads of one KV head, at least 16 (tl.dot)."""


# IEEE float32 dots run on CUDA cores, whose layouts spill registers with most tile shapes; this
# one spills at most 16 bytes for any head size (float32 serving is for checking, not speed).
_FP32_TILES = Tiles(block_n=32, num_warps=8, num_stages=2)


def mixed_tiles(dtype: torch.dtype, head_size: int, gqa: int, max_query_len: int) -> Tiles:
    """`paged_attention`'s tiles: about 64 rows (128 for long prompts: fewer K/V re-reads)."""
    gqa_p = triton.next_power_of_2(gqa)
    if dtype == torch.float32:
        target_m, tiles = 16, _FP32_TILES
    elif head_size > 128:
        target_m, tiles = 64, Tiles(block_n=32, num_warps=8, num_stages=2)
    elif max_query_len >= 512:
        target_m, tiles = 128, Tiles(block_n=64, num_warps=8, num_stages=3)
    else:
        target_m, tiles = 64, Tiles(block_n=64, num_warps=4, num_stages=3)
    block_q = max(1, min(target_m // gqa_p, triton.next_power_of_2(max_query_len)))
    return replace(tiles, block_q=block_q, block_m=max(16, block_q * gqa_p))


def decode_tiles(
    dtype: torch.dtype, head_size: int, cache_dtype: torch.dtype | None = None
) -> Tiles:
    """`paged_decode`'s tiles: a 64 x 128 half-precision K tile is 16 KiB; with three stages K and
    V are double-buffered (the pages are loaded a tile ahead), 70 KiB of shared memory a program,
    so three programs (12 warps) share an SM and keep enough loads in flight to saturate HBM. An
    FP8 cache's tiles are twice as long for the same bytes in flight. Chosen by
    `benchmarks/triton_decode_tiles.py` on an H200."""
    if dtype == torch.float32:
        return _FP32_TILES
    fp8 = cache_dtype == torch.float8_e4m3fn
    if head_size > 128:
        return Tiles(block_n=64 if fp8 else 32, num_warps=4, num_stages=2)
    return Tiles(block_n=128 if fp8 else 64, num_warps=4, num_stages=3)
