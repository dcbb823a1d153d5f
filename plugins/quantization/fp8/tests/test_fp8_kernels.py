"""pagellm-fp8's Triton kernels on the CPU, through Triton's interpreter, against torch.

The quantization kernels must match the torch formula bit for bit (q and scales); the block-scaled
GEMM must match the float64 product of its dequantized operands within float32 accumulation
error. Shapes are small (the interpreter runs each program in NumPy); GPU sizes, timings and the
hardware fp8 conversion are in test_fp8_kernels_gpu.py.

Triton 3.6's interpreter casts float32 to fp8e4nv without carrying a rounding into the exponent
(31.6 becomes 16.0); the kernels round to e4m3 themselves before the cast, so nothing here is
patched: ``test_rounding_to_fp8_matches_torch_on_every_tie_and_subnormal`` checks that rounding
over the whole e4m3 range, and the GPU tests check it against the hardware cast.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace

import pytest
import torch
from fp8_kernel_references import (
    FP8,
    PLUGIN_DIR,
    forget_kernels,
    reference_block_quant_weight,
    reference_block_scaled_mm,
    reference_per_group_quant,
    reference_per_tensor_quant,
    reference_per_token_quant,
    same_bits,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.fixture(scope="module")
def kernels() -> Iterator[SimpleNamespace]:
    """The kernel modules imported afresh under the interpreter."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.syspath_prepend(str(PLUGIN_DIR))
        forget_kernels()
        try:
            from pagellm_fp8.kernels import block_gemm, checks, one_launch, quant, skinny_gemm

            yield SimpleNamespace(
                quant=quant,
                block_gemm=block_gemm,
                checks=checks,
                skinny_gemm=skinny_gemm,
                one_launch=one_launch,
            )
        finally:
            forget_kernels()


def _activations(rows: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random rows of different magnitudes, one of them all zeros, one with a large outlier."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 2, rows)[:, None]
    x[0] = 0.0
    if rows > 1:
        x[1, k // 2] = 3.0e4
    return x.to(dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("k", [1, 100, 4096, 20000])  # 20000: past the one-pass limit
def test_per_token_quant_matches_torch_bit_for_bit(kernels: SimpleNamespace, dtype: str, k: int):
    x = _activations(4, k, DTYPES[dtype])
    q, scales = kernels.quant.per_token_quant_fp8(x)
    ref_q, ref_scales = reference_per_token_quant(x)
    assert q.dtype == FP8 and q.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (4, 1)
    assert torch.equal(scales, ref_scales)
    assert same_bits(q, ref_q)
    assert scales[0].item() > 0 and not q[0].float().any()  # the zero row


def test_rounding_to_fp8_matches_torch_on_every_tie_and_subnormal(kernels: SimpleNamespace):
    finite = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = finite[finite.isfinite()].unique()  # every e4m3 value, -448 to 448
    ties = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([ties.nextafter(grid[1:]), ties.nextafter(grid[:-1])])
    spread = torch.randn(20000, generator=torch.Generator().manual_seed(6))
    spread = spread * 10 ** torch.linspace(-4, 2.6, 20000)
    values = torch.cat([grid, ties, near, spread.clamp(-448, 448)])
    # A static scale of 1 quantizes the values themselves.
    q, _ = kernels.quant.per_tensor_quant_fp8(values[None, :], torch.ones(1))
    assert same_bits(q[0], values.to(FP8))


@pytest.mark.parametrize("fp8", [FP8, torch.float8_e4m3fnuz], ids=["e4m3fn", "e4m3fnuz"])
def test_kernel_rounding_matches_torch_in_both_formats_read_back_as_float32(
    kernels: SimpleNamespace, fp8: torch.dtype
):
    """Every value of the format, the ties between them and their neighbours, a spread over its
    range, and tiny negative values (0 in e4m3fnuz, whose -0 bits are its NaN): the kernels'
    rounding (`rounding._quantize`, written as float32 since the interpreter cannot store
    float8_e4m3fnuz) is torch's cast, bit for bit."""
    from fp8_rounding_probe import rounded

    largest = torch.finfo(fp8).max
    finite = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    grid = finite[finite.isfinite()].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([ties.nextafter(grid[1:]), ties.nextafter(grid[:-1])])
    spread = torch.randn(5000, generator=torch.Generator().manual_seed(7))
    spread = spread * 10 ** torch.linspace(-4, 2.6, 5000)
    tiny = -(10 ** torch.linspace(-9, -4, 50))
    values = torch.cat([grid, ties, near, spread.clamp(-largest, largest), tiny])
    got = rounded(values, fp8)
    expected = values.to(fp8).float()
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))  # -0 is not 0 here
    assert (got == largest).any() and (got.view(torch.int32) == -(2**31)).any() == (fp8 == FP8)


def test_per_token_quant_takes_leading_dims_and_strided_rows(kernels: SimpleNamespace):
    wide = _activations(6, 384, torch.bfloat16, seed=1)
    x = wide[:, 64:320].unflatten(0, (2, 3))  # rows 384 apart, 256 used
    q, scales = kernels.quant.per_token_quant_fp8(x)
    ref_q, ref_scales = reference_per_token_quant(x)
    assert q.shape == (2, 3, 256) and scales.shape == (2, 3, 1)
    assert torch.equal(scales, ref_scales) and same_bits(q, ref_q)


def test_per_token_dequantized_error_is_within_fp8_rounding(kernels: SimpleNamespace):
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(2))
    q, scales = kernels.quant.per_token_quant_fp8(x)
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 above the subnormal range.
    err = (q.float() * scales - x).abs()
    assert torch.all(err <= 2.0**-4 * x.abs() + 2.0**-9 * scales)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    "m, k, row_maxima_max_m",
    [(5, 3000, 1024), (1, 20000, 1024), (4, 300, 2)],  # per row; past one pass; past the rows
)
def test_dynamic_per_tensor_quant_matches_torch(
    kernels: SimpleNamespace, dtype: str, m: int, k: int, row_maxima_max_m: int, monkeypatch
):
    """Up to ``ROW_MAXIMA_MAX_M`` rows of up to ``ONE_PASS_MAX_K`` columns, the scale comes from
    one maximum per row; beyond either, from an atomic maximum per chunk. Rows of 3000 take two
    chunks in the quantization pass, the last partial."""
    monkeypatch.setattr(kernels.quant, "ROW_MAXIMA_MAX_M", row_maxima_max_m)
    x = _activations(m, k, DTYPES[dtype], seed=3)
    q, scale = kernels.quant.per_tensor_quant_fp8(x)
    ref_q, ref_scale = reference_per_tensor_quant(x)
    assert scale.shape == (1,) and torch.equal(scale, ref_scale)
    assert same_bits(q, ref_q)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("m, k", [(1, 4096), (5, 3000), (7, 300)])
def test_one_launch_per_tensor_quant_matches_torch(
    kernels: SimpleNamespace, dtype: str, m: int, k: int
):
    """The one-launch kernel (maxima, grid barrier, quantization in one grid) gives the torch
    formula's bits. The interpreter runs one program (it runs a grid's programs one after
    another, so a barrier across several would never open): every row goes through its loops,
    and the barrier opens for the last (only) arrival; test_fp8_kernels_gpu.py runs it with a
    program per multiprocessor."""
    x = _activations(m, k, DTYPES[dtype], seed=5)
    q, scale = kernels.quant.per_tensor_quant_fp8(x, one_launch=True)
    ref_q, ref_scale = reference_per_tensor_quant(x)
    assert scale.shape == (1,) and torch.equal(scale, ref_scale)
    assert same_bits(q, ref_q)
    assert (
        kernels.one_launch._SYNC[x.device].tolist()[0] == 0
    )  # the count re-armed for the next launch


def test_static_per_tensor_quant_uses_the_given_scale_and_saturates(kernels: SimpleNamespace):
    x = torch.tensor([[0.5, -1.0, 2.0, 100.0], [-1000.0, 0.0, 0.25, 3.0]], dtype=torch.float16)
    scale = torch.tensor([0.01])
    q, out_scale = kernels.quant.per_tensor_quant_fp8(x, scale)
    assert out_scale.data_ptr() == scale.data_ptr()
    assert q.float().tolist() == [[48.0, -96.0, 192.0, 448.0], [-448.0, 0.0, 24.0, 288.0]]


def test_per_tensor_scale_must_be_one_float32_value(kernels: SimpleNamespace):
    x = torch.ones(2, 8)
    with pytest.raises(kernels.checks.Fp8KernelInputError, match="one element"):
        kernels.quant.per_tensor_quant_fp8(x, torch.ones(2))
    with pytest.raises(kernels.checks.Fp8KernelInputError, match="dtype"):
        kernels.quant.per_tensor_quant_fp8(x, torch.ones(1, dtype=torch.float64))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("group, k", [(128, 128), (128, 640), (64, 4096)])
def test_per_token_group_quant_matches_torch(
    kernels: SimpleNamespace, dtype: str, group: int, k: int
):
    x = _activations(3, k, DTYPES[dtype], seed=4)
    q, scales = kernels.quant.per_token_group_quant_fp8(x, group)
    ref_q, ref_scales = reference_per_group_quant(x, group)
    assert scales.shape == (3, k // group) and torch.equal(scales, ref_scales)
    assert same_bits(q, ref_q)


def test_per_token_group_quant_refuses_bad_groups(kernels: SimpleNamespace):
    with pytest.raises(kernels.checks.Fp8KernelInputError, match="not a multiple of the group"):
        kernels.quant.per_token_group_quant_fp8(torch.ones(2, 200), 128)
    with pytest.raises(kernels.checks.Fp8KernelInputError, match="power of two"):
        kernels.quant.per_token_group_quant_fp8(torch.ones(2, 192), 96)


def test_quantization_refuses_integer_activations(kernels: SimpleNamespace):
    with pytest.raises(kernels.checks.Fp8KernelInputError, match="expected one of bfloat16"):
        kernels.quant.per_token_quant_fp8(torch.ones(2, 8, dtype=torch.int32))


def _gemm_operands(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(FP8)
    b = torch.randn(n, k, generator=g).to(FP8)
    a_scales = torch.rand(m, k // 128, generator=g) + 0.25
    b_scales = torch.rand(math.ceil(n / 128), k // 128, generator=g) + 0.25
    return a, a_scales, b, b_scales


# M reaches each tile configuration; N is not a multiple of 128 (a short last weight block).
@pytest.mark.parametrize("m, n, k", [(1, 96, 256), (20, 200, 128), (70, 160, 256), (300, 136, 128)])
def test_block_scaled_mm_matches_float64_reference(
    kernels: SimpleNamespace, m: int, n: int, k: int
):
    a, a_scales, b, b_scales = _gemm_operands(m, n, k)
    out = kernels.block_gemm.block_scaled_mm(a, a_scales, b, b_scales, torch.float32)
    ref = reference_block_scaled_mm(a, a_scales, b, b_scales)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_block_scaled_mm_rounds_to_the_output_dtype(kernels: SimpleNamespace):
    a, a_scales, b, b_scales = _gemm_operands(5, 130, 256, seed=1)
    out = kernels.block_gemm.block_scaled_mm(a, a_scales, b, b_scales, torch.bfloat16)
    ref = reference_block_scaled_mm(a, a_scales, b, b_scales)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref.bfloat16().double(), rtol=2**-7, atol=1e-3)


def test_block_scaled_linear_approximates_the_float_layer(kernels: SimpleNamespace):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 256, generator=g).bfloat16()
    w = (torch.randn(192, 256, generator=g) * 0.05).bfloat16()
    q_w, w_scales = reference_block_quant_weight(w)
    out = kernels.block_gemm.block_scaled_linear(x, q_w, w_scales)
    ref = x.double() @ w.double().T
    assert out.shape == (2, 3, 192) and out.dtype == torch.bfloat16
    # Two fp8 roundings (about 2^-4 relative each) averaged over K = 256 products.
    rel = (out.double() - ref).norm() / ref.norm()
    assert rel < 0.05


def test_block_scaled_mm_refuses_a_k_that_128_does_not_divide(kernels: SimpleNamespace):
    a = torch.zeros(4, 200).to(FP8)
    b = torch.zeros(128, 200).to(FP8)
    with pytest.raises(
        kernels.checks.Fp8KernelInputError, match="K = 200 is not a multiple of 128"
    ):
        kernels.block_gemm.block_scaled_mm(a, torch.ones(4, 1), b, torch.ones(1, 1))


def test_block_scaled_mm_refuses_mismatched_scales_and_dtypes(kernels: SimpleNamespace):
    a, a_scales, b, b_scales = _gemm_operands(4, 256, 256)
    mm = kernels.block_gemm.block_scaled_mm
    error = kernels.checks.Fp8KernelInputError
    with pytest.raises(error, match=r"b_scales has shape \(2, 1\); expected \(2, 2\)"):
        mm(a, a_scales, b, b_scales[:, :1])
    with pytest.raises(error, match=r"a_scales has shape \(4, 1\)"):
        mm(a, a_scales[:, :1], b, b_scales)
    with pytest.raises(error, match="a has dtype torch.bfloat16"):
        mm(a.bfloat16(), a_scales, b, b_scales)
    with pytest.raises(error, match="are not"):
        mm(a, a_scales, b[:, :128], b_scales[:, :1])
    with pytest.raises(error, match="out_dtype"):
        mm(a, a_scales, b, b_scales, torch.int8)


def test_tile_configs_keep_an_n_tile_inside_one_weight_block(kernels: SimpleNamespace):
    gemm: ModuleType = kernels.block_gemm
    configs = [gemm.tile_config(m) for m in [1, 16, 17, 64, 65, 256, 257, 8192]]
    assert all(gemm.SCALE_BLOCK % cfg.block_n == 0 for cfg in configs)
    # Larger batches never get smaller tiles.
    assert [c.block_m for c in configs] == sorted(c.block_m for c in configs)


# ---------------------------------------------------------------------------- skinny GEMM


@pytest.mark.parametrize(
    "m, n, k, block_n, split_k",
    [
        (1, 64, 128, 64, 1),
        (20, 100, 256, 64, 1),
        (37, 130, 128, 32, 1),
        (200, 70, 128, 128, 1),
        (20, 100, 512, 64, 2),  # slices of K added up by atomics
        (3, 40, 512, 32, 4),
    ],
)
def test_skinny_gemm_fp8_matches_the_scaled_float64_product(
    kernels: SimpleNamespace, m: int, n: int, k: int, block_n: int, split_k: int
):
    """Per-tensor scales; M and N not multiples of the tiles (masked rows, never stored)."""
    g = torch.Generator().manual_seed(m + n)
    x = (torch.randn(m, k, generator=g) * 8).to(FP8)
    w = (torch.randn(n, k, generator=g) * 8).to(FP8)
    x_scale, w_scale = torch.tensor([0.03]), torch.tensor([0.007])
    sg = kernels.skinny_gemm
    tiles = sg.SkinnyTiles(block_n=block_n, block_k=128, num_warps=4, num_stages=2, split_k=split_k)
    out = sg.skinny_gemm(x, w, x_scale, w_scale, torch.float32, tiles=tiles)
    ref = (x.double() @ w.double().T) * (0.03 * 0.007)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_skinny_gemm_16_bit_operands_round_to_the_output_dtype(kernels: SimpleNamespace):
    """float16 here: Triton's interpreter multiplies bfloat16 operands' bits, not their values
    (bfloat16 is in the GPU tests)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 128, generator=g).half()
    w = torch.randn(80, 128, generator=g).half()
    out = kernels.skinny_gemm.skinny_gemm(x, w)
    ref = x.double() @ w.double().T
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref.bfloat16().double(), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize(
    "x, w, scales, match",
    [
        (torch.zeros(300, 128).half(), torch.zeros(64, 128).half(), False, "at most 256"),
        (torch.zeros(4, 128).to(FP8), torch.zeros(64, 128).to(FP8), False, "take both scales"),
        (torch.zeros(4, 128).bfloat16(), torch.zeros(64, 128).to(FP8), False, "both float8"),
        (torch.zeros(4, 100).to(FP8), torch.zeros(64, 100).to(FP8), True, "not a multiple"),
        (torch.zeros(4, 384).to(FP8), torch.zeros(64, 384).to(FP8), True, "split_k 2"),
        (torch.zeros(4, 128).half(), torch.zeros(64, 256).half(), False, "are not"),
    ],
)
def test_skinny_gemm_refuses_what_it_cannot_compute(
    kernels: SimpleNamespace, x: torch.Tensor, w: torch.Tensor, scales: bool, match: str
):
    one = torch.ones(1)
    sg = kernels.skinny_gemm
    tiles = sg.SkinnyTiles(block_n=64, block_k=128, num_warps=4, num_stages=2, split_k=2)
    with pytest.raises(kernels.checks.Fp8KernelInputError, match=match):
        sg.skinny_gemm(
            x, w, one if scales else None, one if scales else None,
            tiles=tiles if match == "split_k 2" else None,
        )  # fmt: skip
