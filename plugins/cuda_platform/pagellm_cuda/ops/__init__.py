"""Triton kernels for the CUDA platform's custom ops; the contracts are in
`pagellm.layers.custom_ops`. None of them syncs with the host or allocates beyond its output, and
their grids depend on tensor shapes only, so they can be captured in CUDA graphs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .activation import silu_and_mul
from .kv_write import write_paged_kv
from .layernorm import fused_add_rms_norm, rms_norm
from .qk_norm_rotary import qk_norm_rotary
from .rotary import rotary_embedding

CUSTOM_OPS: dict[str, Callable[..., Any]] = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rotary_embedding": rotary_embedding,
    "qk_norm_rotary": qk_norm_rotary,
    "silu_and_mul": silu_and_mul,
    "write_paged_kv": write_paged_kv,
}

__all__ = [
    "CUSTOM_OPS",
    "fused_add_rms_norm",
    "qk_norm_rotary",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "write_paged_kv",
]
