"""pagellm-fp8's Triton kernels compiled on a CUDA GPU at Llama-3.1-8B sizes: quantization bit
for bit against the torch formula (the hardware fp8 cast included), the block-scaled GEMM against
a float64 product of its dequantized operands, CUDA graph replay identical to eager, and timings
(printed, not asserted: speed belongs to benchmarks/fp8_gemm.py).

Run on the device machine with ``pytest -m gpu -s plugins/quantization/fp8/tests/test_fp8_kernels_gpu.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from types import SimpleNamespace

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

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
        reason="fp8 tensor cores need compute capability 8.9 or more",
    ),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 would not compile"
    ),
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Llama-3.1-8B's four linear layers of one decoder layer: (name, N, K).
LLAMA_LAYERS = [
    ("qkv", 6144, 4096),
    ("o", 4096, 4096),
    ("gate_up", 28672, 4096),
    ("down", 4096, 14336),
]


@pytest.fixture(scope="module")
def kernels() -> Iterator[SimpleNamespace]:
    """The kernel modules, compiled (imported afresh: the CPU tests' copies were interpreted)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(PLUGIN_DIR))
        forget_kernels()
        try:
            from pagellm_fp8.kernels import block_gemm, one_launch, quant, skinny_gemm

            yield SimpleNamespace(
                quant=quant, block_gemm=block_gemm, skinny_gemm=skinny_gemm, one_launch=one_launch
            )
        finally:
            forget_kernels()


@pytest.fixture(autouse=True)
def exact_float32_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def _activations(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows of magnitudes from 1e-3 to 1e2; from 3 rows on, one is all zeros and one has
    a large outlier."""
    g = torch.Generator(device="cuda").manual_seed(m * 7 + k)
    x = torch.randn(m, k, device="cuda", generator=g)
    x *= torch.logspace(-3, 2, m, device="cuda")[:, None]
    if m > 2:
        x[0] = 0.0
        x[1, k // 3] = 3.0e4
    return x.to(dtype)


# Hopper's fp8 tensor cores add a K block's products with less than float32's precision (the
# kernel promotes to float32 every 128): far below bf16 rounding, far above float64's.
GEMM_TOLERANCE = 1e-3


def _assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    tol = GEMM_TOLERANCE
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def _median_us(fn: Callable[[], object]) -> float:
    import triton.testing

    return 1000.0 * triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("m", [1, 256, 8192])
@pytest.mark.parametrize("k", [4096, 14336, 20480])  # 20480: two passes per row
def test_per_token_quant_is_bit_exact_on_gpu(kernels: SimpleNamespace, dtype: str, m: int, k: int):
    x = _activations(m, k, DTYPES[dtype])
    q, scales = kernels.quant.per_token_quant_fp8(x)
    ref_q, ref_scales = reference_per_token_quant(x)
    assert torch.equal(scales, ref_scales)
    assert same_bits(q, ref_q)


@pytest.mark.parametrize("m", [1, 300, 4096])
def test_per_tensor_quant_is_bit_exact_on_gpu(kernels: SimpleNamespace, m: int):
    x = _activations(m, 4096, torch.bfloat16)
    q, scale = kernels.quant.per_tensor_quant_fp8(x)
    ref_q, ref_scale = reference_per_tensor_quant(x)
    assert torch.equal(scale, ref_scale) and same_bits(q, ref_q)
    q_static, _ = kernels.quant.per_tensor_quant_fp8(x, ref_scale)
    assert same_bits(q_static, ref_q)


ONE_LAUNCH_PROBE = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from pagellm_fp8.kernels import quant
for m, k in ((1, 4096), (200, 4096), (1024, 14336)):
    for _ in range(20):
        quant.per_tensor_quant_fp8(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), one_launch=True)
torch.cuda.synchronize()
print("barrier opened")
"""


@pytest.fixture(scope="module")
def barrier_probe() -> str | None:
    """Why the one-launch quantization's grid barrier failed in a child process with a
    deadline, or None: a barrier that never opened would hang a CUDA synchronization, which no
    in-process timeout interrupts, so the in-process tests run only after this."""
    import subprocess
    import sys

    try:
        done = subprocess.run(
            [sys.executable, "-c", ONE_LAUNCH_PROBE, str(PLUGIN_DIR)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        return "the grid barrier did not open within 120 s"
    if done.returncode != 0 or "barrier opened" not in done.stdout:
        return f"the probe failed: {done.stderr[-2000:]}"
    return None


def test_one_launch_quant_barrier_opens_within_seconds(barrier_probe: str | None):
    assert barrier_probe is None, barrier_probe


@pytest.mark.parametrize("m, k", [(1, 4096), (200, 4096), (200, 14336), (1024, 6144)])
def test_one_launch_per_tensor_quant_is_bit_exact_and_replays_on_gpu(
    kernels: SimpleNamespace, barrier_probe: str | None, m: int, k: int
):
    """A program per multiprocessor meeting at the grid barrier, launched again and again
    (eager and from a CUDA graph): the torch formula's bits every time, and the barrier's
    count back at zero after each launch."""
    if barrier_probe is not None:
        pytest.skip(f"not run in process: {barrier_probe}")
    x = _activations(m, k, torch.bfloat16)
    ref_q, ref_scale = reference_per_tensor_quant(x)
    for _ in range(3):
        q, scale = kernels.quant.per_tensor_quant_fp8(x, one_launch=True)
        assert torch.equal(scale, ref_scale) and same_bits(q, ref_q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernels.quant.per_tensor_quant_fp8(x, one_launch=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, scale = kernels.quant.per_tensor_quant_fp8(x, one_launch=True)
    for flip in (True, False, True):
        fresh = _activations(m, k, torch.bfloat16)
        x.copy_(fresh.flip(0) if flip else fresh)
        ref_q, ref_scale = reference_per_tensor_quant(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(scale, ref_scale) and same_bits(q, ref_q)
    assert kernels.one_launch._SYNC[x.device].tolist()[0] == 0


@pytest.mark.parametrize("m, k", [(1, 4096), (333, 14336), (8192, 4096)])
def test_per_token_group_quant_is_bit_exact_on_gpu(kernels: SimpleNamespace, m: int, k: int):
    x = _activations(m, k, torch.bfloat16)
    q, scales = kernels.quant.per_token_group_quant_fp8(x, 128)
    ref_q, ref_scales = reference_per_group_quant(x, 128)
    assert torch.equal(scales, ref_scales) and same_bits(q, ref_q)


@pytest.mark.parametrize("layer, n, k", LLAMA_LAYERS)
@pytest.mark.parametrize("m", [1, 16, 100, 1024])  # every tile configuration; 100: a partial tile
def test_block_scaled_mm_matches_float64_reference_at_llama_shapes(
    kernels: SimpleNamespace, layer: str, n: int, k: int, m: int
):
    x = _activations(m, k, torch.bfloat16)
    a, a_scales = kernels.quant.per_token_group_quant_fp8(x, 128)
    g = torch.Generator(device="cuda").manual_seed(n + k)
    b, b_scales = reference_block_quant_weight(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    out = kernels.block_gemm.block_scaled_mm(a, a_scales, b, b_scales, torch.float32)
    ref = reference_block_scaled_mm(a, a_scales, b, b_scales)
    _assert_close_to_reference(out, ref)
    out_bf16 = kernels.block_gemm.block_scaled_mm(a, a_scales, b, b_scales, torch.bfloat16)
    torch.testing.assert_close(out_bf16, out.bfloat16(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("layer, n, k", LLAMA_LAYERS)
@pytest.mark.parametrize("m", [1, 16, 200, 256])
def test_skinny_gemm_matches_float64_reference_at_llama_shapes(
    kernels: SimpleNamespace, layer: str, n: int, k: int, m: int
):
    """FP8 with per-tensor scales (warpgroup FP8 MMAs) and bf16, each tile width, K split."""
    sg = kernels.skinny_gemm
    x = _activations(m, k, torch.bfloat16)
    q, x_scale = kernels.quant.per_tensor_quant_fp8(x)
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    w_q, w_scale = kernels.quant.per_tensor_quant_fp8(w)
    ref = (q.double() @ w_q.double().T) * (x_scale.double() * w_scale.double())
    for block_n, warps, split_k in ((32, 4, 1), (64, 4, 1), (128, 8, 1), (128, 8, 4)):
        tiles = sg.SkinnyTiles(
            block_n=block_n, block_k=128, num_warps=warps, num_stages=3, split_k=split_k
        )
        out = sg.skinny_gemm(q, w_q, x_scale, w_scale, torch.float32, tiles=tiles)
        _assert_close_to_reference(out, ref)
    out_bf16 = sg.skinny_gemm(x, w)
    ref_bf16 = x.double() @ w.double().T
    torch.testing.assert_close(
        out_bf16.double(), ref_bf16, rtol=2**-7, atol=1e-3 * ref_bf16.abs().max().item()
    )


def test_block_scaled_mm_handles_an_n_past_the_last_full_block(kernels: SimpleNamespace):
    x = _activations(77, 1024, torch.float16)
    a, a_scales = kernels.quant.per_token_group_quant_fp8(x, 128)
    w = torch.randn(1000, 1024, device="cuda") * 0.02  # 7 full blocks and one of 104 rows
    b, b_scales = reference_block_quant_weight(w)
    out = kernels.block_gemm.block_scaled_mm(a, a_scales, b, b_scales, torch.float32)
    ref = reference_block_scaled_mm(a, a_scales, b, b_scales)
    _assert_close_to_reference(out, ref)


def test_quantize_and_gemm_replay_from_a_cuda_graph_as_eager(kernels: SimpleNamespace):
    x = _activations(64, 4096, torch.bfloat16)
    w, w_scales = reference_block_quant_weight(torch.randn(4096, 4096, device="cuda") * 0.02)

    def step() -> tuple[torch.Tensor, ...]:
        q, s = kernels.quant.per_token_quant_fp8(x)
        qt, st = kernels.quant.per_tensor_quant_fp8(x)
        return q, s, qt, st, kernels.block_gemm.block_scaled_linear(x, w, w_scales)

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x.copy_(_activations(64, 4096, torch.bfloat16).flip(0))
    graph.replay()
    x.copy_(_activations(64, 4096, torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager, strict=True):
        assert same_bits(got, want) if got.dtype == FP8 else torch.equal(got, want)


def test_print_quantization_and_gemm_timings(kernels: SimpleNamespace):
    for m, k in [(256, 4096), (8192, 4096), (8192, 14336)]:
        x = _activations(m, k, torch.bfloat16)
        fused = _median_us(lambda x=x: kernels.quant.per_token_quant_fp8(x))
        torch_ops = _median_us(lambda x=x: reference_per_token_quant(x))
        group = _median_us(lambda x=x: kernels.quant.per_token_group_quant_fp8(x))
        print(f"\nper-token quant M={m} K={k}: fused {fused:.1f} us, torch ops {torch_ops:.1f} us, "
              f"per-group(128) {group:.1f} us")  # fmt: skip
    m, n, k = 8192, 28672, 4096
    a, a_scales = kernels.quant.per_token_group_quant_fp8(_activations(m, k, torch.bfloat16))
    b, b_scales = reference_block_quant_weight(torch.randn(n, k, device="cuda") * 0.02)
    us = _median_us(lambda: kernels.block_gemm.block_scaled_mm(a, a_scales, b, b_scales))
    print(f"block-scaled mm {m}x{n}x{k}: {us:.0f} us, {2 * m * n * k / us / 1e6:.0f} TFLOP/s")
