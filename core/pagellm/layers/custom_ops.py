"""Fused kernels a platform may provide in place of the layers' plain torch code.

The platform's `custom_ops()` maps these names to callables; each layer looks its op up once, when
it is built, and falls back to torch when the platform has none. The contracts:

- ``rms_norm(x, weight, eps) -> out``: ``x`` [tokens, hidden] (rows may be strided); normalises
  in float32, then scales by ``weight`` in ``x``'s dtype, as the Hugging Face models do.
- ``fused_add_rms_norm(x, residual, weight, eps) -> (out, new_residual)``: ``new_residual = x +
  residual`` and ``out = rms_norm(new_residual)``. May write the results into ``x`` and ``residual``.
- ``rotary_embedding(positions, q, k, head_size, cos_sin_cache) -> None``: rotates ``q``
  [tokens, heads * head_size] and ``k`` [tokens, kv_heads * head_size] in place, rotate-half
  layout, with ``cos_sin_cache`` [max_position, head_size] float32 (cos halves, then sin halves).
- ``silu_and_mul(x) -> out``: ``silu(x[:, :d]) * x[:, d:]`` for ``x`` [tokens, 2 * d].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

OP_NAMES = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul")


def get_custom_op(name: str) -> Callable[..., Any] | None:
    """The current platform's kernel for ``name``, or None (use torch)."""
    from pagellm.platforms import current_platform

    if name not in OP_NAMES:
        raise ValueError(f"Unknown custom op {name!r}; known: {list(OP_NAMES)}.")
    return current_platform.custom_ops().get(name)
