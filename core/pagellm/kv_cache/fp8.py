"""Float8 (e4m3) KV cache entries: one scale per layer for keys and one for values.

An entry stores ``value / scale`` rounded to nearest-even and saturated to +-448 (e4m3 has no
infinity: an unsaturated overflow would be NaN). The reference quantization every backend's
kernels are tested against, and the TORCH_SDPA backend's own.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = float(torch.finfo(FP8_KV_DTYPE).max)


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` in float8_e4m3fn, saturated; multiplies by the float32 reciprocal, as the
    Triton write kernel does, so both round identically."""
    return (x.float() * (1.0 / scale)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)
