"""A kernel that writes what `pagellm_fp8.kernels.quant`'s quantization computes, as float32,
for a float8 format Triton's interpreter cannot store (float8_e4m3fnuz: Triton's fp8e4b8 has no
interpreter type). Imported by test_fp8_kernels.py once its fixture has made the kernels
interpreted."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from pagellm_fp8.kernels.rounding import _quantize, format_constants


@triton.jit
def _rounded_kernel(
    x_ptr,
    out_ptr,
    n,
    FP8_MAX: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUBNORMAL_ROUNDER: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
    HW_CAST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    q = _quantize(x, 1.0, FP8_MAX, MIN_NORMAL, SUBNORMAL_ROUNDER, SIGNED_ZERO, HW_CAST)
    tl.store(out_ptr + offs, q, mask=mask)


def rounded(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` (float32, 1-D) quantized with a scale of 1 to ``dtype``, as float32."""
    out = torch.empty_like(values)
    block = 1024
    _rounded_kernel[(triton.cdiv(values.numel(), block),)](
        values, out, values.numel(), **format_constants(dtype, hardware_cast=False), BLOCK=block
    )
    return out
