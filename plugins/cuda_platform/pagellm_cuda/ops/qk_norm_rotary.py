"""Per-head RMSNorm of q and k, then their rotary embedding, in place: one program per token, all
of its q heads and k heads (Qwen3's attention prologue in one launch instead of three).

The rounding is that of the unfused torch path (`pagellm.layers.layernorm.RMSNorm` on each head,
then `pagellm.layers.rotary_embedding.RotaryEmbedding`), as the `rms_norm` and `rotary_embedding`
kernels have it: the sum of squares in float32, the normalised head rounded to the dtype, scaled
by the weight in one float32 product rounded to the dtype (the norm's output), then rotated in
float32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from .rotary import check_rotary_inputs, launch_shape


@triton.jit
def _norm_rotate_heads(
    row_ptr,
    n_heads,
    weight_ptr,
    eps,
    cos,
    sin,
    HEAD_SIZE: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    half: tl.constexpr = HEAD_SIZE // 2
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (cols < half)
    first = row_ptr + heads * HEAD_SIZE + cols
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_SIZE + eps)
    rstd = rstd[:, None]
    w_mask = cols < half
    w1 = tl.load(weight_ptr + cols, mask=w_mask, other=0.0).to(dtype).to(tl.float32)
    w2 = tl.load(weight_ptr + half + cols, mask=w_mask, other=0.0).to(dtype).to(tl.float32)
    n1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    n2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    tl.store(first, (n1 * cos - n2 * sin).to(dtype), mask=mask)
    tl.store(first + half, (n2 * cos + n1 * sin).to(dtype), mask=mask)


@triton.jit
def _qk_norm_rotary_kernel(
    positions_ptr,
    positions_stride,
    q_ptr,
    q_row_stride,
    k_ptr,
    k_row_stride,
    q_weight_ptr,
    k_weight_ptr,
    eps,
    cache_ptr,
    cache_row_stride,
    n_q_heads,
    n_k_heads,
    HEAD_SIZE: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_K_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token * positions_stride).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    mask = cols < HEAD_SIZE // 2
    cache_row = cache_ptr + position * cache_row_stride
    cos = tl.load(cache_row + cols, mask=mask, other=0.0)[None, :]
    sin = tl.load(cache_row + HEAD_SIZE // 2 + cols, mask=mask, other=0.0)[None, :]
    _norm_rotate_heads(
        q_ptr + token * q_row_stride,
        n_q_heads,
        q_weight_ptr,
        eps,
        cos,
        sin,
        HEAD_SIZE,
        BLOCK_Q_HEADS,
        BLOCK_HALF,
    )
    _norm_rotate_heads(
        k_ptr + token * k_row_stride,
        n_k_heads,
        k_weight_ptr,
        eps,
        cos,
        sin,
        HEAD_SIZE,
        BLOCK_K_HEADS,
        BLOCK_HALF,
    )


def qk_norm_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    *,
    target: GPUTarget | None = None,
) -> None:
    """RMSNorm each head of ``q`` [tokens, heads * head_size] (scaled by ``q_weight``
    [head_size]) and of ``k`` [tokens, kv_heads * head_size] (by ``k_weight``), then rotate both
    by ``cos_sin_cache[positions]`` ([max_position, head_size] float32: cos half, sin half), in
    place. Rows of ``q`` and ``k`` may be strided (views into a fused qkv tensor). ``target``: the
    GPU to size the launch for, when not ``q``'s own (`warp_size`)."""
    positions = positions.reshape(-1)
    tokens = positions.shape[0]
    check_rotary_inputs("qk_norm_rotary", q, k, tokens, head_size, cos_sin_cache)
    if q.dtype != k.dtype:
        raise ValueError(f"qk_norm_rotary needs q and k of one dtype, got {q.dtype}, {k.dtype}.")
    if q_weight.numel() != head_size or k_weight.numel() != head_size:
        raise ValueError(
            f"qk_norm_rotary weights must have head_size ({head_size}) elements, got "
            f"{q_weight.numel()} (q) and {k_weight.numel()} (k)."
        )
    if tokens == 0:
        return
    # The rotary kernel's tile and warps (this kernel is built on its tile).
    n_q_heads, n_k_heads, tile = launch_shape(q, k, head_size, target)
    _qk_norm_rotary_kernel[(tokens,)](
        positions,
        positions.stride(0),
        q,
        q.stride(0),
        k,
        k.stride(0),
        q_weight.contiguous(),
        k_weight.contiguous(),
        eps,
        cos_sin_cache,
        cos_sin_cache.stride(0),
        n_q_heads,
        n_k_heads,
        **tile,
    )
