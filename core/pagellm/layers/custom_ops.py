"""Fused kernels a platform may provide in place of the layers' plain torch code.

The platform's `custom_ops()` maps these names to callables; each layer looks its op up once, when
it is built, and falls back to torch when the platform has none. The contracts:

- ``rms_norm(x, weight, eps) -> out``: ``x`` [tokens, hidden] (rows may be strided) or [tokens,
  heads, head_size] (tokens and heads may be strided; normalised per head); normalises
  in float32, then scales by ``weight`` in ``x``'s dtype, as the Hugging Face models do.
- ``fused_add_rms_norm(x, residual, weight, eps) -> (out, new_residual)``: ``new_residual = x +
  residual`` and ``out = rms_norm(new_residual)``. May write the results into ``x`` and ``residual``.
- ``rotary_embedding(positions, q, k, head_size, cos_sin_cache) -> None``: rotates ``q``
  [tokens, heads * head_size] and ``k`` [tokens, kv_heads * head_size] in place, rotate-half
  layout, with ``cos_sin_cache`` [max_position, head_size] float32 (cos halves, then sin halves).
- ``qk_norm_rotary(positions, q, k, q_weight, k_weight, eps, head_size, cos_sin_cache) -> None``:
  normalises each head of ``q`` [tokens, heads * head_size] and ``k`` [tokens, kv_heads *
  head_size] (rows may be strided views into a fused qkv tensor; unit column stride) by RMSNorm
  with ``eps``, scaled by ``q_weight`` or ``k_weight`` [head_size], then rotates them as
  ``rotary_embedding`` does; all in place. Rounded as the unfused layers are: the norm as
  ``rms_norm``'s (float32 sum of squares, the normalised head rounded to the dtype, then scaled
  by the weight in the dtype), the rotation in float32 with one rounding. Models with q/k norms
  (Qwen3) call it instead of ``rms_norm`` on each head followed by ``rotary_embedding``.
- ``silu_and_mul(x) -> out``: ``silu(x[:, :d]) * x[:, d:]`` for ``x`` [tokens, 2 * d].
- ``write_paged_kv(key, value, key_cache, value_cache, slot_mapping) -> None``: stores ``key`` and
  ``value`` [tokens, kv_heads, head_size] at their slots of caches of token-major pages,
  [num_blocks, block_size, kv_heads, head_size] (any strides, the last dimension contiguous),
  slot ``s`` being position ``s % block_size`` of block ``s // block_size``; a slot of -1 (a
  padding token of a captured graph) is written nowhere. Attention backends use it;
  `write_paged_kv` below is the torch version.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

OP_NAMES = (
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "qk_norm_rotary",
    "silu_and_mul",
    "write_paged_kv",
)


def get_custom_op(name: str) -> Callable[..., Any] | None:
    """The current platform's kernel for ``name``, or None (use torch)."""
    from pagellm.platforms import current_platform

    if name not in OP_NAMES:
        raise ValueError(f"Unknown custom op {name!r}; known: {list(OP_NAMES)}.")
    return current_platform.custom_ops().get(name)


def write_paged_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``write_paged_kv`` in torch (``index_copy_``), for caches whose pages are contiguous
    (slot ``s`` is row ``s`` of the cache seen as [num_blocks * block_size, kv_heads, head_size]).
    Padding slots (-1) copy slot 0 onto itself; slot 0 is in the null block, which no request's
    K/V goes to."""
    padded = slot_mapping < 0
    slots = slot_mapping.clamp(min=0)
    for new, cache in ((key, key_cache), (value, value_cache)):
        flat = cache.view(-1, *cache.shape[2:])
        flat.index_copy_(0, slots, torch.where(padded[:, None, None], flat[0], new))
