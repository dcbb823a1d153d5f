"""Rotary embedding (rotate-half layout) of q and k in place: one program per token, all heads.

Arithmetic is float32 with one rounding to the input dtype at the end, as in the torch path of
`pagellm.layers.rotary_embedding.RotaryEmbedding` (the compiler may contract a product and the
sum into one FMA, which moves a float32 result by at most an ulp before that rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from .target import warp_size


@triton.jit
def _rotate_heads(
    row_ptr,
    n_heads,
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
    tl.store(first, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(first + half, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    positions_stride,
    q_ptr,
    q_row_stride,
    k_ptr,
    k_row_stride,
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
    _rotate_heads(
        q_ptr + token * q_row_stride, n_q_heads, cos, sin, HEAD_SIZE, BLOCK_Q_HEADS, BLOCK_HALF
    )
    _rotate_heads(
        k_ptr + token * k_row_stride, n_k_heads, cos, sin, HEAD_SIZE, BLOCK_K_HEADS, BLOCK_HALF
    )


def check_rotary_inputs(
    op: str, q: torch.Tensor, k: torch.Tensor, tokens: int, head_size: int, cache: torch.Tensor
) -> None:
    """The shapes ``op`` (this kernel, or one built on its tile) needs: ``q`` and ``k`` rows of
    whole heads with unit column stride (written in place), an even ``head_size`` and a float32
    [max_position, head_size] ``cache``."""
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 2 or t.shape[0] != tokens or t.shape[1] % head_size or t.stride(1) != 1:
            raise ValueError(
                f"{op} {name} must be [{tokens} tokens, heads * {head_size}] with unit column "
                f"stride (written in place), got shape {tuple(t.shape)} strides {t.stride()}."
            )
    if head_size % 2 or cache.dim() != 2 or cache.shape[1] != head_size:
        raise ValueError(
            f"{op} needs an even head_size and a [max_position, {head_size}] "
            f"cos_sin_cache, got head_size {head_size} and cache {tuple(cache.shape)}."
        )
    if cache.dtype != torch.float32 or cache.stride(1) != 1:
        raise ValueError(f"{op} needs a float32 cos_sin_cache with unit column stride.")


def launch_shape(
    q: torch.Tensor, k: torch.Tensor, head_size: int, target: GPUTarget | None
) -> tuple[int, int, dict[str, int]]:
    """Heads of ``q`` and ``k``, and the tile constants and warps of one program per token over
    all of them (about eight elements of each half per thread)."""
    n_q_heads, n_k_heads = q.shape[1] // head_size, k.shape[1] // head_size
    block_half = triton.next_power_of_2(head_size // 2)
    block_q_heads = triton.next_power_of_2(n_q_heads)
    threads = warp_size(q.device, target)
    return (
        n_q_heads,
        n_k_heads,
        {
            "HEAD_SIZE": head_size,
            "BLOCK_Q_HEADS": block_q_heads,
            "BLOCK_K_HEADS": triton.next_power_of_2(n_k_heads),
            "BLOCK_HALF": block_half,
            "num_warps": min(8, max(1, block_q_heads * block_half // (8 * threads))),
        },
    )


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    *,
    target: GPUTarget | None = None,
) -> None:
    """Rotate ``q`` [tokens, heads * head_size] and ``k`` [tokens, kv_heads * head_size] in
    place by ``cos_sin_cache[positions]`` ([max_position, head_size] float32: cos half, sin
    half). Rows of ``q`` and ``k`` may be strided (views into a fused qkv tensor). ``target``: the
    GPU to size the launch for, when not ``q``'s own (`warp_size`)."""
    positions = positions.reshape(-1)
    tokens = positions.shape[0]
    check_rotary_inputs("rotary_embedding", q, k, tokens, head_size, cos_sin_cache)
    if tokens == 0:
        return
    n_q_heads, n_k_heads, tile = launch_shape(q, k, head_size, target)
    _rotary_kernel[(tokens,)](
        positions,
        positions.stride(0),
        q,
        q.stride(0),
        k,
        k.stride(0),
        cos_sin_cache,
        cos_sin_cache.stride(0),
        n_q_heads,
        n_k_heads,
        **tile,
    )
