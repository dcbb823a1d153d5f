"""The Triton kernels of `pagellm_fp8.kernels.fused_input`: RMSNorm (with or without the residual
add) and SiLU-and-multiply writing their output quantized, one program per token.

Each computes its layer's output as the platform's unfused kernels round it (the residual sum,
the normalised row and the scaled row each rounded to the activation dtype; ``silu(gate)``
rounded before the product), then `_store_row` quantizes that row in registers as ``MODE`` says:

- 0, ``TOKEN``: one scale per row, ``max(amax / FP8_MAX, MIN_SCALE)``;
- 1, ``STATIC``: the one calibrated scale at ``scale_ptr``;
- 2, ``GROUP``: one scale per row and group of ``GROUP`` columns (the block-scaled GEMM's input);
- 3, ``ROW_MAX``: no quantization: the row in the activation dtype and its max |value|, for a
  dynamic per-tensor scale, which needs every row first.

Every value quantizes as `pagellm_fp8.kernels.rounding` says.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagellm_fp8.kernels.rounding import _quantize, _scale_of

TOKEN, STATIC, GROUP, ROW_MAX = 0, 1, 2, 3
"""The values of the kernels' ``MODE``."""


@triton.jit
def _store_row(
    y,
    cols,
    row,
    n_cols,
    out_ptr,
    out_stride,
    scale_ptr,
    scale_stride,
    row_max_ptr,
    FP8_MAX: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUBNORMAL_ROUNDER: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
    HW_CAST: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    MODE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row ``row``'s values ``y`` (float32 of the activation dtype; zero beyond ``n_cols``)
    quantized as ``MODE`` says, or stored as they are with their max |value| (``ROW_MAX``)."""
    out_row = out_ptr + row * out_stride
    mask = cols < n_cols
    if MODE == 3:  # ROW_MAX
        tl.store(out_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(row_max_ptr + row, tl.max(tl.abs(y), axis=0))
    elif MODE == 2:  # GROUP
        groups = tl.reshape(y, (BLOCK // GROUP, GROUP))
        scales = _scale_of(tl.max(tl.abs(groups), axis=1), FP8_MAX, MIN_SCALE)
        q = _quantize(
            groups, scales[:, None], FP8_MAX, MIN_NORMAL, SUBNORMAL_ROUNDER, SIGNED_ZERO, HW_CAST
        )
        q = tl.reshape(q, (BLOCK,))
        tl.store(out_row + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
        group_ids = tl.arange(0, BLOCK // GROUP)
        tl.store(
            scale_ptr + row * scale_stride + group_ids,
            scales,
            mask=group_ids < n_cols // GROUP,
        )
    else:
        if MODE == 0:  # TOKEN
            scale = _scale_of(tl.max(tl.abs(y), axis=0), FP8_MAX, MIN_SCALE)
            tl.store(scale_ptr + row * scale_stride, scale)
        else:  # STATIC
            scale = tl.load(scale_ptr)
        q = _quantize(y, scale, FP8_MAX, MIN_NORMAL, SUBNORMAL_ROUNDER, SIGNED_ZERO, HW_CAST)
        tl.store(out_row + cols, q.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr,
    x_stride,
    residual_ptr,
    residual_stride,
    weight_ptr,
    out_ptr,
    out_stride,
    scale_ptr,
    scale_stride,
    row_max_ptr,
    n_cols,
    eps,
    FP8_MAX: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUBNORMAL_ROUNDER: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
    HW_CAST: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    MODE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    dtype = x_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_row = residual_ptr + row * residual_stride
        residual = tl.load(residual_row + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
        tl.store(residual_row + cols, x, mask=mask)
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = (x * rstd).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(dtype).to(tl.float32)
    y = (normed * weight).to(dtype).to(tl.float32)
    _store_row(
        y,
        cols,
        row,
        n_cols,
        out_ptr,
        out_stride,
        scale_ptr,
        scale_stride,
        row_max_ptr,
        FP8_MAX,
        MIN_NORMAL,
        SUBNORMAL_ROUNDER,
        SIGNED_ZERO,
        HW_CAST,
        MIN_SCALE,
        MODE,
        GROUP,
        BLOCK,
    )


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr,
    x_stride,
    out_ptr,
    out_stride,
    scale_ptr,
    scale_stride,
    row_max_ptr,
    d,
    FP8_MAX: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUBNORMAL_ROUNDER: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
    HW_CAST: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    MODE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    dtype = x_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    x_row = x_ptr + row * x_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    y = (silu * up).to(dtype).to(tl.float32)
    _store_row(
        y,
        cols,
        row,
        d,
        out_ptr,
        out_stride,
        scale_ptr,
        scale_stride,
        row_max_ptr,
        FP8_MAX,
        MIN_NORMAL,
        SUBNORMAL_ROUNDER,
        SIGNED_ZERO,
        HW_CAST,
        MIN_SCALE,
        MODE,
        GROUP,
        BLOCK,
    )
