"""The two float8 e4m3 formats a platform computes in (`Platform.fp8_dtype`), and the exact
conversion of fp8 checkpoints from the one they are written in to the other.

Checkpoints store float8_e4m3fn (the OCP format) with float32 scales, ``value = fp8 * scale``.
AMD CDNA3 GPUs (gfx940-gfx942) compute in float8_e4m3fnuz: the same layout with exponent bias 8
instead of 7, so the same bits mean half the value, largest finite value 240 instead of 448, and
one bit pattern that differs in meaning: 0x80 is negative zero in e4m3fn and NaN in e4m3fnuz.
Converting is therefore exact and costs no rounding: keep the bits, turn 0x80 into 0x00 (+0),
and double every scale. e4m3fn's NaNs (0x7F, 0xFF) would become the finite values ±240 in
e4m3fnuz, so a tensor holding them is refused.
"""

from __future__ import annotations

import torch

E4M3FN = torch.float8_e4m3fn
E4M3FNUZ = torch.float8_e4m3fnuz
FP8_FORMATS = (E4M3FN, E4M3FNUZ)
"""The float8 formats pagellm's fp8 code computes in: checkpoints' own, and CDNA3's."""

_NEGATIVE_ZERO = -128
"""0x80 read as int8: -0.0 in float8_e4m3fn, NaN in float8_e4m3fnuz."""
_E4M3FN_NAN = 0x7F
"""float8_e4m3fn's NaN, with either sign: the low seven bits all set."""


class Fp8ConversionError(ValueError):
    """An fp8 tensor that cannot be converted to float8_e4m3fnuz."""


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of ``dtype``: 448 for float8_e4m3fn, 240 for float8_e4m3fnuz."""
    return float(torch.finfo(dtype).max)


def e4m3fn_to_e4m3fnuz(
    weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``weight`` (float8_e4m3fn) as float8_e4m3fnuz with its scales doubled, so that
    ``fnuz.float() * 2 * weight_scale == weight.float() * weight_scale`` for every element.

    ``weight_scale`` may be per tensor, per channel or per block (any shape: only its values
    change); ``input_scale``, a static activation scale, is doubled too, since activations are
    quantized to the same format. Returns new tensors; the inputs are left as they were.
    """
    if weight.dtype != E4M3FN:
        raise Fp8ConversionError(
            f"expected a float8_e4m3fn weight to convert to float8_e4m3fnuz, got {weight.dtype}."
        )
    bits = weight.view(torch.int8)
    nans = int(((bits & _E4M3FN_NAN) == _E4M3FN_NAN).sum())
    if nans:
        raise Fp8ConversionError(
            f"the fp8 weight holds {nans} NaN value(s) (bit pattern 0x7F or 0xFF), which "
            "float8_e4m3fnuz cannot represent (they would read as +-240); the checkpoint is "
            "corrupt: re-quantize it."
        )
    converted = torch.where(bits == _NEGATIVE_ZERO, torch.zeros_like(bits), bits)
    doubled_input = None if input_scale is None else input_scale * 2.0
    return converted.view(E4M3FNUZ), weight_scale * 2.0, doubled_input
