"""`pagellm_fp8.kernels.fused_input` on the CPU, through Triton's interpreter: RMSNorm (with and
without the residual add) and SiLU-and-multiply, each writing its output quantized.

Two properties make "the same as unfused": the layer's output (`rms_norm_row_max`,
`silu_and_mul_row_max`: the first launch of the per-tensor mode, which writes it in the
activation dtype) matches the torch layers within 2 ulps, as the platform kernels do; and each
mode's quantization of it is bit for bit the torch formula's (the unfused quantization kernels
are, test_fp8_kernels.py). The GPU run of the same checks is in test_fp8_kernels_gpu.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
from fp8_kernel_references import (
    FP8,
    fresh_kernel_module,
    reference_mode_quant,
    reference_per_tensor_quant,
    reference_per_token_quant,
    same_bits,
)

from pagellm.layers.activation import silu_and_mul_torch
from pagellm.layers.layernorm import rms_norm_torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Relative error of 2 ulps at the bottom of a binade, what the platform's kernels are allowed
# in 16 bits; float32 as close as theirs (1e-5: a sum's order, exp's last bit).
RTOL = {torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9, torch.float32: 1e-5}
ATOL = {torch.bfloat16: 1e-6, torch.float16: 1e-6, torch.float32: 1e-5}
EPS = 1e-5
STATIC_SCALE = torch.tensor([0.02])


@pytest.fixture(scope="module")
def fused() -> Iterator[ModuleType]:
    """The kernel module imported afresh under the interpreter, which rounds to bfloat16 as
    the GPU does (it truncates otherwise)."""
    with fresh_kernel_module("fused_input", interpret=True) as module:
        yield module


def _rows(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of different magnitudes, one with a large outlier."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-2, 1, rows)[:, None]
    x[-1, cols // 3] = 300.0
    return x.to(dtype)


def _norm_inputs(rows: int, hidden: int, dtype: torch.dtype):
    x, residual = _rows(rows, hidden, dtype, 1), _rows(rows, hidden, dtype, 2)
    weight = (1.0 + 0.5 * torch.randn(hidden, generator=torch.Generator().manual_seed(3))).to(dtype)
    return x, residual, weight


def _assert_within_two_ulps(out: torch.Tensor, ref: torch.Tensor) -> None:
    err = (out.float() - ref.float()).abs()
    assert (err <= RTOL[out.dtype] * ref.float().abs() + ATOL[out.dtype]).all(), err.max()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("hidden", [64, 384, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_rows_match_the_torch_layer(
    fused: ModuleType, dtype: str, hidden: int, with_residual: bool
):
    x, residual, weight = _norm_inputs(5, hidden, DTYPES[dtype])
    expected_residual = x + residual
    res = residual.clone() if with_residual else None
    out, row_max = fused.rms_norm_row_max(x, weight, EPS, res)
    ref = rms_norm_torch(expected_residual if with_residual else x, weight, EPS)
    assert out.dtype == x.dtype and out.shape == x.shape
    _assert_within_two_ulps(out, ref)
    assert torch.equal(row_max, out.float().abs().amax(dim=1))
    if with_residual:
        assert torch.equal(res, expected_residual)  # one rounding of an exact sum


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", ["token", "group", "static", "tensor"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quant_is_the_quantized_norm_bit_for_bit(
    fused: ModuleType, dtype: str, mode: str, with_residual: bool
):
    x, residual, weight = _norm_inputs(6, 384, DTYPES[dtype])
    res = residual.clone() if with_residual else None
    normed, _ = fused.rms_norm_row_max(x, weight, EPS, res)
    expected_residual = res
    res = residual.clone() if with_residual else None
    static = STATIC_SCALE if mode == "static" else None

    result = fused.rms_norm_quant(x, weight, EPS, mode, FP8, res, static)

    assert result is not None
    q, scale = result
    ref_q, ref_scale = reference_mode_quant(normed, mode, STATIC_SCALE)
    assert q.dtype == FP8 and q.shape == x.shape
    assert scale.shape == ref_scale.shape and torch.equal(scale, ref_scale)
    assert same_bits(q, ref_q)
    if with_residual:
        assert torch.equal(res, expected_residual)


def test_a_per_tensor_scale_of_more_rows_than_one_program_reduces(fused: ModuleType):
    """Past 1,024 rows the rows' maxima are reduced first (a third launch): the same bits."""
    x, residual, weight = _norm_inputs(1100, 64, torch.bfloat16)
    res = residual.clone()
    normed, _ = fused.rms_norm_row_max(x, weight, EPS, res)
    res = residual.clone()
    result = fused.rms_norm_quant(x, weight, EPS, "tensor", FP8, res)
    assert result is not None
    q, scale = result
    ref_q, ref_scale = reference_per_tensor_quant(normed)
    assert torch.equal(scale, ref_scale) and same_bits(q, ref_q)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("d", [128, 640, 4096])
def test_silu_and_mul_rows_match_the_torch_layer(fused: ModuleType, dtype: str, d: int):
    x = _rows(4, 2 * d, DTYPES[dtype], 4)
    out, row_max = fused.silu_and_mul_row_max(x)
    ref = silu_and_mul_torch(x)
    assert out.dtype == x.dtype and out.shape == (4, d)
    # exp differs from torch's in its last ulp, and silu is rounded before the product.
    _assert_within_two_ulps(out, ref)
    assert torch.equal(row_max, out.float().abs().amax(dim=1))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", ["token", "group", "static", "tensor"])
def test_silu_and_mul_quant_is_the_quantized_product_bit_for_bit(
    fused: ModuleType, dtype: str, mode: str
):
    x = _rows(5, 2 * 640, DTYPES[dtype], 5)
    product, _ = fused.silu_and_mul_row_max(x)
    static = STATIC_SCALE if mode == "static" else None

    result = fused.silu_and_mul_quant(x, mode, FP8, static)

    assert result is not None
    q, scale = result
    ref_q, ref_scale = reference_mode_quant(product, mode, STATIC_SCALE)
    assert q.shape == product.shape and torch.equal(scale, ref_scale)
    assert same_bits(q, ref_q)


def test_strided_rows_are_read_in_place(fused: ModuleType):
    """A [tokens, hidden] view with a row stride beyond hidden (a slice of a wider buffer)."""
    wide = _rows(4, 512, torch.bfloat16, 6)
    x = wide[:, :256]
    weight = torch.ones(256, dtype=torch.bfloat16)
    result = fused.rms_norm_quant(x, weight, EPS, "token", FP8)
    assert result is not None
    q, scale = result
    ref_q, ref_scale = reference_per_token_quant(
        fused.rms_norm_row_max(x.contiguous(), weight, EPS)[0]
    )
    assert same_bits(q, ref_q) and torch.equal(scale, ref_scale)


def test_shapes_the_kernels_do_not_fuse_return_none(fused: ModuleType):
    """The caller then runs the layers unfused; nothing is launched or written."""
    weight = torch.ones(16386, dtype=torch.bfloat16)
    long_rows = torch.zeros(2, 16386, dtype=torch.bfloat16)
    residual = torch.ones_like(long_rows)
    assert fused.rms_norm_quant(long_rows, weight, EPS, "token", FP8, residual) is None
    assert torch.equal(residual, torch.ones_like(long_rows))  # not added to
    assert fused.silu_and_mul_quant(torch.zeros(2, 2 * 16392), "token", FP8) is None
    not_groups = torch.zeros(2, 200, dtype=torch.bfloat16)
    assert fused.rms_norm_quant(not_groups, weight[:200], EPS, "group", FP8) is None


def test_bad_inputs_are_refused_with_the_reason(fused: ModuleType):
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    weight = torch.ones(64, dtype=torch.bfloat16)
    error = fused.Fp8KernelInputError
    with pytest.raises(error, match="mode 'row' is not one of"):
        fused.rms_norm_quant(x, weight, EPS, "row", FP8)
    with pytest.raises(error, match="a static scale is given with mode 'static', and only then"):
        fused.rms_norm_quant(x, weight, EPS, "static", FP8)
    with pytest.raises(error, match="weight has 32 elements; rows have 64"):
        fused.rms_norm_quant(x, weight[:32], EPS, "token", FP8)
    with pytest.raises(error, match="residual is torch.float16"):
        fused.rms_norm_quant(x, weight, EPS, "token", FP8, x.half())
    with pytest.raises(error, match="x has dtype torch.int32"):
        fused.silu_and_mul_quant(x.int(), "token", FP8)
    with pytest.raises(error, match="x has 63 columns; SiLU-and-multiply needs an even number"):
        fused.silu_and_mul_quant(x[:, :63], "token", FP8)
    with pytest.raises(error, match="expected \\[tokens, columns\\] with unit column stride"):
        fused.silu_and_mul_quant(x.t(), "token", FP8)
    with pytest.raises(error, match="not a float8 format"):
        fused.silu_and_mul_quant(x, "token", torch.bfloat16)


@pytest.mark.parametrize("mode", ["token", "static", "tensor"])
def test_the_triton_input_quantizer_hands_layers_the_kernels_results(fused: ModuleType, mode: str):
    """`TritonInputQuantizer` (the CUDA path of the contract) on the interpreted kernels: the
    norm's and the activation's quantized outputs and the residual sum, and None (unfused) for
    inputs that are not rows with unit column stride."""
    from pagellm_fp8.input_quant import TritonInputQuantizer

    static = STATIC_SCALE if mode == "static" else None
    quantizer = TritonInputQuantizer(fused, mode, FP8, static)
    x, residual, weight = _norm_inputs(3, 256, torch.bfloat16)
    expected = fused.rms_norm_quant(x, weight, EPS, mode, FP8, residual.clone(), static)
    res = residual.clone()
    quantized, new_residual = quantizer.fused_add_rms_norm(x, res, weight, EPS)
    assert new_residual is res and torch.equal(res, x + residual)
    assert same_bits(quantized.data, expected[0]) and torch.equal(quantized.scale, expected[1])
    assert quantized.dtype == torch.bfloat16
    first = quantizer.rms_norm(x, weight, EPS)
    assert same_bits(first.data, fused.rms_norm_quant(x, weight, EPS, mode, FP8, None, static)[0])
    gate_up = _rows(3, 512, torch.bfloat16, 7)
    activation = quantizer.silu_and_mul(gate_up)
    assert same_bits(activation.data, fused.silu_and_mul_quant(gate_up, mode, FP8, static)[0])
    assert quantizer.silu_and_mul(gate_up.t()) is None
    assert quantizer.rms_norm(x.view(3, 2, 128), weight[:128], EPS) is None
    assert quantizer.fused_add_rms_norm(x, residual.t().contiguous().t(), weight, EPS) is None
