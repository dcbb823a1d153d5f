"""The rounding every FP8 quantization kernel shares: ``scale = max(amax / FP8_MAX, MIN_SCALE)``
and ``q = clamp(x / scale, -FP8_MAX, FP8_MAX)`` in float32 with IEEE-rounded divisions (Triton's
plain ``/`` on float32 is approximate on NVIDIA GPUs), rounded to the float8 format to nearest
even: bit for bit what the same formula in torch gives (see ``reference_per_token_quant`` in the
tests), on GPUs and in Triton's interpreter. On NVIDIA GPUs float8_e4m3fn is rounded by the
hardware conversion the store does (``HW_CAST``); elsewhere by integer operations that repeat it
(`_round_to_e4m3`), which made the kernels bound by their instructions rather than by memory.
The format is float8_e4m3fn (FP8_MAX 448) unless ``dtype`` asks for AMD CDNA3's float8_e4m3fnuz
(FP8_MAX 240, subnormals an exponent lower, no negative zero); Triton's interpreter cannot store
float8_e4m3fnuz, so that format's rounding is tested there on float32 outputs
(test_fp8_fnuz.py) and its kernels are compiled for gfx942 (pagellm-rocm's tests).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagellm_fp8.kernels.checks import FP8_DTYPE, require_fp8_format

# Keeps an all-zero row's scale finite and non-zero (its values quantize to 0 all the same).
MIN_SCALE = 1e-12


def num_warps_for(block: int) -> int:
    """Warps for a program of ``block`` elements: about 16 to 32 elements per thread."""
    return max(1, min(16, block // 512))


def hardware_rounds(dtype: torch.dtype) -> bool:
    """Whether the kernels leave the rounding to ``dtype`` to the store's conversion: float8_e4m3fn
    on NVIDIA GPUs (``cvt.rn.satfinite.e4m3x2.f32``, to nearest even, as torch rounds). Not in
    Triton's interpreter (its cast rounds ties away from zero and drops the carry into the
    exponent), nor for float8_e4m3fnuz, nor on ROCm, whose conversions are not checked here."""
    return (
        dtype == FP8_DTYPE
        and os.environ.get("TRITON_INTERPRET", "0") != "1"
        and torch.version.hip is None
    )


def format_constants(
    dtype: torch.dtype, hardware_cast: bool | None = None
) -> dict[str, float | bool]:
    """The kernels' compile-time constants for the float8 format ``dtype``: its largest value,
    its smallest normal value, the float32 constant whose addition rounds to its subnormal
    spacing (1.5 times the power of two at which float32's spacing is that: e4m3 keeps 3
    mantissa bits, so the spacing is the smallest normal / 8), whether it has a -0, and whether
    the store's conversion rounds (``hardware_cast``; by default `hardware_rounds`)."""
    require_fp8_format(dtype)
    info = torch.finfo(dtype)
    return dict(
        FP8_MAX=float(info.max),
        MIN_NORMAL=float(info.smallest_normal),
        SUBNORMAL_ROUNDER=1.5 * info.smallest_normal / 8 * 2.0**23,
        SIGNED_ZERO=dtype == FP8_DTYPE,
        HW_CAST=hardware_rounds(dtype) if hardware_cast is None else hardware_cast,
    )


@triton.jit
def _round_to_e4m3(
    v, MIN_NORMAL: tl.constexpr, SUBNORMAL_ROUNDER: tl.constexpr, SIGNED_ZERO: tl.constexpr
):
    """``v`` (float32, |v| <= FP8_MAX) rounded to the nearest e4m3 value, ties to even, as
    float32.

    The cast to fp8 that follows then has nothing left to round: the result is the same on every
    Triton backend, including the interpreter, whose float32 -> fp8 cast (Triton 3.6) drops the
    carry of a rounding into the exponent (31.6 -> 16.0). On GPUs it repeats what the hardware
    cast does, a few integer operations in a kernel bound by memory.
    """
    bits = v.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = bits & 0x7FFFFFFF
    # Normal e4m3 values keep 3 of float32's 23 mantissa bits: add just under half of the 20
    # dropped bits' unit, plus the kept lowest bit (ties to even), and truncate.
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & 0xFFF00000
    # Below the smallest normal (e4m3fn: 2^-6) the spacing is an eighth of it (2^-9): float32's
    # spacing at 1.5 * 2^14, so adding and subtracting that constant rounds to it.
    a = tl.abs(v)
    subnormal = ((a + SUBNORMAL_ROUNDER) - SUBNORMAL_ROUNDER).to(tl.uint32, bitcast=True)
    rounded = tl.where(a < MIN_NORMAL, subnormal, normal)
    if not SIGNED_ZERO:  # e4m3fnuz: the bits of -0 are its NaN
        sign = tl.where(rounded == 0, 0, sign)
    return (rounded | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize(
    x,
    scale,
    FP8_MAX: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUBNORMAL_ROUNDER: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    """``x / scale`` clamped to the format's range, as float32: rounded to the format's values,
    unless ``HW_CAST`` (the store's conversion then rounds, to nearest even)."""
    q = tl.math.div_rn(x, scale)
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    if HW_CAST:
        return q
    return _round_to_e4m3(q, MIN_NORMAL, SUBNORMAL_ROUNDER, SIGNED_ZERO)


@triton.jit
def _scale_of(amax, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    return tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)
