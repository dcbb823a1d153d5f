"""The conversion of float8_e4m3fn checkpoints to float8_e4m3fnuz (AMD CDNA3's fp8), over every
bit pattern (`pagellm.quantization.fp8_formats`); pagellm-fp8 applies it at load where the
platform computes in float8_e4m3fnuz (plugins/quantization/fp8/tests/test_fp8_fnuz.py)."""

from __future__ import annotations

import pytest
import torch

from pagellm.quantization.fp8_formats import Fp8ConversionError, e4m3fn_to_e4m3fnuz, fp8_max

FNUZ, FN = torch.float8_e4m3fnuz, torch.float8_e4m3fn
ALL_BITS = torch.arange(256, dtype=torch.int32).to(torch.uint8)
NAN_BITS = {0x7F, 0xFF}


def e4m3fn_patterns() -> torch.Tensor:
    """Every float8_e4m3fn bit pattern but the two NaNs."""
    keep = torch.tensor([int(b) not in NAN_BITS for b in ALL_BITS])
    return ALL_BITS[keep].view(FN)


def test_the_formats_largest_values():
    assert (fp8_max(FN), fp8_max(FNUZ)) == (448.0, 240.0)


def test_conversion_keeps_every_value_exactly():
    weight = e4m3fn_patterns()
    assert weight.float().abs().max() == 448.0  # e4m3fn's whole range, converted without loss
    scale = torch.tensor([0.0123], dtype=torch.float32)
    fnuz, fnuz_scale, _ = e4m3fn_to_e4m3fnuz(weight, scale)
    assert fnuz.dtype == FNUZ and fnuz.shape == weight.shape
    assert torch.equal(fnuz_scale, scale * 2)
    assert torch.equal(fnuz.float() * fnuz_scale, weight.float() * scale)
    assert not torch.isnan(fnuz.float()).any()


def test_negative_zero_becomes_zero_and_other_bits_are_kept():
    weight = e4m3fn_patterns()
    fnuz, _, _ = e4m3fn_to_e4m3fnuz(weight, torch.ones(1))
    before, after = weight.view(torch.uint8), fnuz.view(torch.uint8)
    negative_zero = before == 0x80
    assert negative_zero.sum() == 1 and after[negative_zero].item() == 0
    assert torch.equal(after[~negative_zero], before[~negative_zero])
    # 0x80 read as fnuz without the conversion is NaN: the case the conversion exists for.
    assert torch.isnan(torch.tensor([0x80], dtype=torch.uint8).view(FNUZ).float()).all()


def test_scales_of_any_granularity_and_the_input_scale_are_doubled():
    weight = torch.randn(4, 256).to(FN)
    block_scales = torch.rand(1, 2) + 0.5
    input_scale = torch.tensor([0.25])
    fnuz, scale, doubled_input = e4m3fn_to_e4m3fnuz(weight, block_scales, input_scale)
    assert torch.equal(scale, block_scales * 2)
    assert doubled_input is not None and doubled_input.item() == 0.5
    assert input_scale.item() == 0.25 and weight.dtype == FN  # the inputs are left alone
    assert e4m3fn_to_e4m3fnuz(weight, block_scales)[2] is None


def test_nan_and_wrong_dtypes_are_refused():
    nan = torch.tensor([0x10, 0x7F, 0xFF], dtype=torch.uint8).view(FN)
    with pytest.raises(Fp8ConversionError, match=r"2 NaN value\(s\)"):
        e4m3fn_to_e4m3fnuz(nan, torch.ones(1))
    with pytest.raises(Fp8ConversionError, match="expected a float8_e4m3fn weight"):
        e4m3fn_to_e4m3fnuz(torch.ones(2, dtype=torch.bfloat16), torch.ones(1))
