"""Writing the new tokens' K/V into the paged cache: one program per token, all its KV heads.

An FP8 cache (float8_e4m3fn) stores ``value * (1 / scale)``, saturated to +-448 and rounded to
nearest-even, as `pagellm.kv_cache.fp8.quantize_kv` does (so never a NaN: a NaN input saturates
too), its values token-minor within a page (`launch.split_kv_cache`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from .launch import (
    FP8_E4M3_MAX,
    check_inner_contiguous,
    gpu_target,
    is_fp8_cache,
    values_token_minor,
)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    inv_k_scale,
    inv_v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ch,
    stride_cs,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    QUANTIZE: tl.constexpr,
    V_TOKEN_MINOR: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return  # CUDA-graph padding
    offs_h = tl.arange(0, HEADS_P)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_SIZE)
    page_head = (slot // PAGE) * stride_cb + offs_h[:, None] * stride_ch
    dst = page_head + (slot % PAGE) * stride_cs + offs_d[None, :]
    # A constexpr branch (Triton compiles only the taken one), not a ternary.
    if V_TOKEN_MINOR:  # noqa: SIM108
        dst_v = page_head + slot % PAGE + offs_d[None, :] * PAGE
    else:
        dst_v = dst
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask)
    if QUANTIZE:
        k = k.to(tl.float32) * inv_k_scale
        k = tl.minimum(tl.maximum(k, -FP8_E4M3_MAX), FP8_E4M3_MAX).to(k_cache_ptr.dtype.element_ty)
        v = v.to(tl.float32) * inv_v_scale
        v = tl.minimum(tl.maximum(v, -FP8_E4M3_MAX), FP8_E4M3_MAX).to(v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + dst, k, mask)
    tl.store(v_cache_ptr + dst_v, v, mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    target: GPUTarget | None = None,
) -> None:
    """Store ``key``/``value`` ``[T, num_kv_heads, head_size]`` (last dim contiguous) at
    ``slot_mapping[:T]`` in caches indexed ``[num_blocks, num_kv_heads, block_size, head_size]``
    (`split_kv_cache`); an FP8 cache gets them divided by ``k_scale``/``v_scale``. ``target``:
    the GPU to size the launch for, when not the tensors' own (`gpu_target`; cross-compiling
    passes it)."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    check_inner_contiguous(key, value, key_cache)
    v_token_minor = values_token_minor(key_cache, value_cache)
    heads_p = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_size)
    if target is None:
        target = gpu_target(key.device)
    warp_size = 32 if target is None else target.warp_size
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        1.0 / k_scale,
        1.0 / v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_P=heads_p,
        HEAD_SIZE=head_size,
        BLOCK_D=block_d,
        PAGE=key_cache.shape[2],
        QUANTIZE=is_fp8_cache(key_cache),
        V_TOKEN_MINOR=v_token_minor,
        # About eight elements per thread: one 16-byte vector for bf16 (4 warps of 32 threads
        # for an 8 x 128 tile).
        num_warps=max(1, min(8, heads_p * block_d // (8 * warp_size))),
    )
