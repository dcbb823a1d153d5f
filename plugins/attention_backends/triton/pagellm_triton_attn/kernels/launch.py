"""Launch parameters of the attention kernels: tile shapes per GPU target, dtype and head size,
dot precision, and the stride every kernel assumes of its tensors.

The target is the one Triton compiles for on the tensors' device (`gpu_target`): NVIDIA GPUs get
the tiles tuned on an H200; AMD GPUs (``hip`` targets) get tiles sized by their wavefront and LDS
(`_hip_tiles`), untuned for lack of an AMD GPU but checked by compiling for gfx942, gfx950 and
gfx1100 (pagellm-rocm's tests). On the CPU (Triton's interpreter) there is no target: the NVIDIA
tiles are interpreted.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

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


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value caches of TRITON_ATTN's ``[2, num_blocks, num_kv_heads, block_size,
    head_size]`` cache, both indexed ``[block, kv_head, slot, dim]``.

    Keys are stored as indexed (one page of one KV head is a ``block_size x head_size`` tile).
    An FP8 cache stores each page's values token-minor (``head_size x block_size``): P @ V
    reduces over the keys, and an 8-bit MMA operand must be contiguous along the reduced
    dimension (there is no transposing ``ldmatrix`` for 8-bit elements, so a slot-major V tile
    is read from shared memory a byte at a time). The value cache returned is then a transposed
    view of the same memory, whose strides the kernels read (`values_token_minor`)."""
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    if is_fp8_cache(kv_cache):
        num_blocks, num_kv_heads, block_size, head_size = value_cache.shape
        value_cache = value_cache.view(num_blocks, num_kv_heads, head_size, block_size)
        value_cache = value_cache.transpose(2, 3)
    return key_cache, value_cache


def values_token_minor(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether ``value_cache`` is stored token-minor within a page (an FP8 cache's values, from
    `split_kv_cache`) rather than as ``key_cache`` is. The kernels address V with K's block and
    head strides, so both must agree; anything else raises.

    The kernels load token-minor V tiles without masking the slots past a sequence's end
    (masking them per slot would keep the loads from being vectorized): that is safe because
    an FP8 cache never holds a NaN, since `TritonAttentionBackend.allocate_kv_cache` zeroes it
    and every write saturates at +-448, and such slots get softmax weight 0."""
    shape, strides = tuple(value_cache.shape), value_cache.stride()
    if shape != tuple(key_cache.shape) or strides[:2] != key_cache.stride()[:2]:
        raise ValueError(
            f"value cache {shape} with strides {strides} does not match the key cache "
            f"{tuple(key_cache.shape)} with strides {key_cache.stride()}"
        )
    if strides[2:] == key_cache.stride()[2:]:
        return False
    if strides[2:] == (1, shape[2]) and is_fp8_cache(value_cache):
        return True
    raise ValueError(
        f"value cache strides {strides}: expected those of the key cache {key_cache.stride()} "
        f"or, for an FP8 cache, token-minor pages {(*strides[:2], 1, shape[2])}"
    )


def check_inner_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(
                f"expected the last dimension to be contiguous, got strides {t.stride()}"
            )


@functools.cache
def _device_target(index: int) -> GPUTarget:
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip is not None:
        return GPUTarget("hip", props.gcnArchName.split(":")[0], props.warp_size)
    return GPUTarget("cuda", props.major * 10 + props.minor, 32)


def gpu_target(device: torch.device) -> GPUTarget | None:
    """The target Triton compiles for on ``device`` (asked once per device); None off the GPU."""
    if device.type != "cuda":
        return None
    return _device_target(torch.cuda.current_device() if device.index is None else device.index)


def dot_precision(dtype: torch.dtype, target: GPUTarget | None = None) -> str:
    # float32 models expect float32 attention, not TF32's 10-bit mantissa. For half-precision
    # operands the choice does not matter; AMD targets other than gfx942 offer no "tf32".
    hip = target is not None and target.backend == "hip"
    return "ieee" if dtype == torch.float32 or hip else "tf32"


@dataclass(frozen=True)
class Tiles:
    """Launch shape of an attention kernel. On NVIDIA GPUs, untuned defaults for Hopper
    (H100/H200), checked by compiling for sm_90: no register spills, shared memory well under
    the 227 KiB limit; on AMD GPUs, `_hip_tiles`."""

    block_n: int
    """Keys per tile."""
    num_warps: int
    num_stages: int
    block_q: int = 1
    """Query tokens per program (`paged_attention`)."""
    block_m: int = 16
    """Rows per program: query tokens x the query heads of one KV head, at least 16 (tl.dot)."""
    swap_ab: bool = False
    """`paged_decode` only: both products transposed (S^T = K Q^T, O^T += V^T P^T), so the key
    tile's rows are the MMA's M dimension rather than the 16 padded query rows; on sm_90 Triton
    then emits warpgroup MMAs (compiled for sm_90: HGMMA.64x16x16 where the default kernel has
    HMMA.16816). Off by default until measured faster (`benchmarks/triton_decode_tiles.py`)."""
    fp8_mma: bool = False
    """With ``swap_ab``, over an FP8 cache: each row's query and the softmax weights are
    rounded to e4m3 too, so both products run as FP8 warpgroup MMAs (QGMMA.64x16x32 on sm_90)
    on the tiles as loaded, with no conversion of K and V. Less exact: both operands of each
    product are e4m3, against one (about 1 % of the values' scale where the logits are O(1)).
    Off by default."""


# IEEE float32 dots run on CUDA cores, whose layouts spill registers with most tile shapes; this
# one spills at most 16 bytes for any head size (float32 serving is for checking, not speed).
_FP32_TILES = Tiles(block_n=32, num_warps=8, num_stages=2)


_HIP_THREADS = 256
"""Threads per program on AMD GPUs: 4 wavefronts of 64 on CDNA, 8 of 32 on RDNA (with 4, RDNA3
spills the accumulators to scratch)."""
_HIP_KV_LDS = 32 * 1024
"""LDS for one stage of K and V tiles: two programs per CU (or WGP) within the 64 KiB that
CDNA3 and RDNA give a workgroup."""


def _hip_tiles(target: GPUTarget, head_size: int, kv_bytes: int, max_block_n: int) -> Tiles:
    """Tiles for an AMD GPU: ``block_n`` keys so that one K and one V tile fit `_HIP_KV_LDS`,
    two stages (Triton's AMD pipeliner then loads the next tiles into LDS while the current ones
    are used: one stage buffered), `_HIP_THREADS` threads per program."""
    block_d = triton.next_power_of_2(head_size)
    block_n = min(max_block_n, max(16, _HIP_KV_LDS // (2 * block_d * kv_bytes)))
    num_warps = max(1, _HIP_THREADS // target.warp_size)
    return Tiles(block_n=block_n, num_warps=num_warps, num_stages=2)


def mixed_tiles(
    dtype: torch.dtype,
    head_size: int,
    gqa: int,
    max_query_len: int,
    target: GPUTarget | None = None,
) -> Tiles:
    """`paged_attention`'s tiles: about 64 rows (128 for long prompts: fewer K/V re-reads).
    On AMD GPUs: on CDNA 64 rows (16 in float32) over at most 64 keys; on RDNA 16 rows over at
    most 32 keys (16 in float32), the largest tiles RDNA3 compiles without spilling registers."""
    gqa_p = triton.next_power_of_2(gqa)
    if target is not None and target.backend == "hip":
        cdna = target.warp_size == 64
        max_block_n = 64 if cdna else (16 if dtype == torch.float32 else 32)
        tiles = _hip_tiles(target, head_size, dtype.itemsize, max_block_n)
        target_m = 64 if cdna and dtype != torch.float32 else 16
    elif dtype == torch.float32:
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
    dtype: torch.dtype,
    head_size: int,
    cache_dtype: torch.dtype | None = None,
    target: GPUTarget | None = None,
) -> Tiles:
    """`paged_decode`'s tiles: a 64 x 128 half-precision K tile is 16 KiB; with three stages K and
    V are double-buffered (the pages are loaded a tile ahead), 70 KiB of shared memory a program,
    so three programs (12 warps) share an SM and keep enough loads in flight to saturate HBM. An
    FP8 cache's tiles are twice as long for the same bytes in flight, in two stages (its values
    token-minor, it measured 2,914 GB/s at 256 x 1k against 2,812 with three). Chosen by
    `benchmarks/triton_decode_tiles.py` on an H200. On AMD GPUs: `_hip_tiles`, up to 128 keys."""
    if target is not None and target.backend == "hip":
        kv_bytes = (cache_dtype or dtype).itemsize
        return _hip_tiles(target, head_size, kv_bytes, 128)
    if dtype == torch.float32:
        return _FP32_TILES
    fp8 = cache_dtype == torch.float8_e4m3fn
    if head_size > 128:
        return Tiles(block_n=64 if fp8 else 32, num_warps=4, num_stages=2)
    if fp8:
        return Tiles(block_n=128, num_warps=4, num_stages=2)
    return Tiles(block_n=64, num_warps=4, num_stages=3)
