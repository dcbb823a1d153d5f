"""FP8 quantization and dequantization in plain torch: weights at load time, activations where no
fused kernel is available, and the reference path's dequantization. Scales are float32 and
multiply: ``value ~= fp8 * scale``. Quantizing takes the float8 format to write (``dtype``, the
platform's `Platform.fp8_dtype`: float8_e4m3fn, largest value 448, or float8_e4m3fnuz, 240)."""

from __future__ import annotations

import torch

from pagellm.quantization.fp8_formats import E4M3FN, fp8_max
from pagellm_fp8.scheme import BLOCK, ActivationGranularity, WeightGranularity

FP8_DTYPE = E4M3FN
"""The format fp8 checkpoints are written in, and the default one to quantize to."""
# A zero tensor (or row, block) still gets a usable scale, and its values quantize to 0.
_MIN_AMAX = 1e-12


def _over_fp8_max(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``amax / fp8_max(dtype)``, rounded as IEEE division on every device (on CUDA, torch
    divides by a Python number as a multiplication by its reciprocal, which can differ in the
    last bit from the fused kernels' division)."""
    return amax / amax.new_full((), fp8_max(dtype))


def to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = FP8_DTYPE) -> torch.Tensor:
    """``x / scale`` (``scale`` broadcast over ``x``), saturated to ``dtype``'s range (torch
    casts what lies beyond it to NaN)."""
    largest = fp8_max(dtype)
    return (x.float() / scale).clamp(-largest, largest).to(dtype)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    rows, cols = w.shape
    return w.reshape(rows // BLOCK[0], BLOCK[0], cols // BLOCK[1], BLOCK[1])


def _expand_block_scales(scale: torch.Tensor) -> torch.Tensor:
    return scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)


def quantize_weight(
    w: torch.Tensor, granularity: WeightGranularity, dtype: torch.dtype = FP8_DTYPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float ``w`` [N, K] -> (``dtype`` [N, K], scales: [1], [N, 1] or [N/128, K/128])."""
    w = w.float()
    if granularity == "tensor":
        scale = _over_fp8_max(w.abs().amax().clamp(min=_MIN_AMAX).reshape(1), dtype)
        return to_fp8(w, scale, dtype), scale
    if granularity == "channel":
        scale = _over_fp8_max(w.abs().amax(dim=1, keepdim=True).clamp(min=_MIN_AMAX), dtype)
        return to_fp8(w, scale, dtype), scale
    scale = _over_fp8_max(_blocks(w).abs().amax(dim=(1, 3)).clamp(min=_MIN_AMAX), dtype)
    return to_fp8(w, _expand_block_scales(scale), dtype), scale


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, granularity: WeightGranularity
) -> torch.Tensor:
    """The float32 weight [N, K] that ``q`` and its scales stand for."""
    if granularity == "block":
        return q.float() * _expand_block_scales(scale)
    return q.float() * scale


def quantize_activation(
    x: torch.Tensor,
    granularity: ActivationGranularity,
    static_scale: torch.Tensor | None = None,
    dtype: torch.dtype = FP8_DTYPE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (``dtype`` [M, K], scales: [1], [M, 1] or [M, K/128]); ``static_scale``
    (a calibrated per-tensor scale, for ``dtype``) replaces the computed one."""
    if static_scale is not None:
        return to_fp8(x, static_scale, dtype), static_scale
    if granularity == "tensor":
        scale = _over_fp8_max(x.abs().amax().float().clamp(min=_MIN_AMAX).reshape(1), dtype)
        return to_fp8(x, scale, dtype), scale
    if granularity == "token":
        amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=_MIN_AMAX)
        scale = _over_fp8_max(amax, dtype)
        return to_fp8(x, scale, dtype), scale
    m, k = x.shape
    groups = x.reshape(m, k // BLOCK[1], BLOCK[1])
    scale = _over_fp8_max(groups.abs().amax(dim=2).float().clamp(min=_MIN_AMAX), dtype)
    return to_fp8(groups, scale.unsqueeze(2), dtype).reshape(m, k), scale


def dequantize_activation(
    q: torch.Tensor, scale: torch.Tensor, granularity: ActivationGranularity
) -> torch.Tensor:
    if granularity == "group":
        return q.float() * scale.repeat_interleave(BLOCK[1], 1)
    return q.float() * scale
