"""Writing a step's new K/V into a paged cache of token-major pages (``[num_blocks, block_size,
kv_heads, head_size]``, as FlashAttention and FlashInfer page through it): one program per new
token, copying all its KV heads of K and of V.

Torch's ``index_copy_`` does the same in two launches at about a third of the bandwidth (1.45 ms
against 0.49 ms per 8,192-token step of a 28-layer model on the H200, `benchmarks/step_profile.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from .target import warp_size


@triton.jit
def _write_paged_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    key_token_stride,
    key_head_stride,
    value_token_stride,
    value_head_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    HEADS: tl.constexpr,
    HEADS_POW2: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_POW2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # -1: a padding token of a captured graph, written nowhere
        heads = tl.arange(0, HEADS_POW2)[:, None]
        dims = tl.arange(0, HEAD_SIZE_POW2)[None, :]
        mask = (heads < HEADS) & (dims < HEAD_SIZE)
        where = (
            (slot // BLOCK_SIZE) * cache_block_stride
            + (slot % BLOCK_SIZE) * cache_slot_stride
            + heads * cache_head_stride
            + dims
        )
        row = token.to(tl.int64)
        k = tl.load(key_ptr + row * key_token_stride + heads * key_head_stride + dims, mask)
        tl.store(key_cache_ptr + where, k, mask)
        v = tl.load(value_ptr + row * value_token_stride + heads * value_head_stride + dims, mask)
        tl.store(value_cache_ptr + where, v, mask)


def write_paged_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    target: GPUTarget | None = None,
) -> None:
    """The contract of `pagellm.layers.custom_ops` (``write_paged_kv``); ``target``: the GPU to
    size the launch for, when not ``key``'s own (`warp_size`)."""
    num_tokens, heads, head_size = key.shape
    if num_tokens == 0:
        return
    if key_cache.stride() != value_cache.stride() or key_cache.dtype != key.dtype:
        raise ValueError(
            f"write_paged_kv needs K and V caches of one layout in the keys' dtype, got strides "
            f"{key_cache.stride()} / {value_cache.stride()} of {key_cache.dtype} for {key.dtype}"
        )
    for t in (key, value, key_cache, value_cache):
        if t.stride(-1) != 1:
            raise ValueError(f"write_paged_kv needs a contiguous last dimension, got {t.stride()}")
    heads_pow2, size_pow2 = triton.next_power_of_2(heads), triton.next_power_of_2(head_size)
    _write_paged_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        HEADS=heads,
        HEADS_POW2=heads_pow2,
        HEAD_SIZE=head_size,
        HEAD_SIZE_POW2=size_pow2,
        BLOCK_SIZE=key_cache.shape[1],
        num_warps=max(1, min(8, heads_pow2 * size_pow2 // (8 * warp_size(key.device, target)))),
    )
