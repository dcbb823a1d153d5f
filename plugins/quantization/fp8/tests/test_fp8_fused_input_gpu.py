"""`pagellm_fp8.kernels.fused_input` compiled on a CUDA GPU at Llama-3.1-8B sizes: each mode's
quantization bit for bit the torch formula's over the layer's own output (the hardware fp8 cast
included), that output within 2 ulps of the CUDA platform's unfused kernels, CUDA graph replay
identical to eager, and the engine with fused input quantization (the default) agreeing with the
bf16 model as the unfused fp8 engine does.

Run on the device machine with ``pytest -m gpu -s plugins/quantization/fp8/tests/test_fp8_fused_input_gpu.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
from fp8_kernel_references import (
    FP8,
    fresh_kernel_module,
    reference_mode_quant,
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

HIDDEN, INTERMEDIATE = 4096, 14336
EPS = 1e-5
MODES = ["token", "group", "static", "tensor"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module")
def fused() -> Iterator[ModuleType]:
    """The kernel module, compiled (imported afresh: the CPU tests' copy was interpreted)."""
    with fresh_kernel_module("fused_input", interpret=False) as module:
        yield module


def _rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g)
    x *= torch.logspace(-2, 1, m, device="cuda")[:, None]
    return x.to(dtype)


def _static() -> torch.Tensor:
    return torch.tensor([0.02], device="cuda")


def _within_two_ulps(out: torch.Tensor, ref: torch.Tensor) -> None:
    rtol = 2.0**-6 if out.dtype == torch.bfloat16 else 2.0**-9
    err = (out.float() - ref.float()).abs()
    assert (err <= rtol * ref.float().abs() + 1e-6).all(), err.max()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("m", [1, 200, 1024, 8192])  # 8192: per tensor, the maxima reduced first
@pytest.mark.parametrize("mode", MODES)
def test_fused_norm_quantizes_its_output_bit_for_bit(
    fused: ModuleType, dtype: str, m: int, mode: str
):
    x, residual = _rows(m, HIDDEN, DTYPES[dtype], 1), _rows(m, HIDDEN, DTYPES[dtype], 2)
    weight = _rows(1, HIDDEN, DTYPES[dtype], 3)[0] + 1
    normed_residual = residual.clone()
    normed, row_max = fused.rms_norm_row_max(x, weight, EPS, normed_residual)
    assert torch.equal(row_max, normed.float().abs().amax(dim=1))
    res = residual.clone()
    static = _static() if mode == "static" else None

    result = fused.rms_norm_quant(x, weight, EPS, mode, FP8, res, static)

    assert result is not None
    q, scale = result
    ref_q, ref_scale = reference_mode_quant(normed, mode, _static())
    assert torch.equal(scale, ref_scale) and same_bits(q, ref_q)
    assert torch.equal(res, normed_residual)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("m", [1, 200, 1024])
@pytest.mark.parametrize("mode", MODES)
def test_fused_silu_and_mul_quantizes_its_output_bit_for_bit(
    fused: ModuleType, dtype: str, m: int, mode: str
):
    x = _rows(m, 2 * INTERMEDIATE, DTYPES[dtype], 4)
    product, _ = fused.silu_and_mul_row_max(x)
    result = fused.silu_and_mul_quant(x, mode, FP8, _static() if mode == "static" else None)
    assert result is not None
    q, scale = result
    ref_q, ref_scale = reference_mode_quant(product, mode, _static())
    assert torch.equal(scale, ref_scale) and same_bits(q, ref_q)


@pytest.mark.parametrize("m", [1, 200, 4096])
def test_fused_outputs_match_the_cuda_platform_kernels(fused: ModuleType, m: int):
    ops = pytest.importorskip("pagellm_cuda.ops")
    x, residual = _rows(m, HIDDEN, torch.bfloat16, 5), _rows(m, HIDDEN, torch.bfloat16, 6)
    weight = _rows(1, HIDDEN, torch.bfloat16, 7)[0] + 1
    expected, expected_residual = ops.CUSTOM_OPS["fused_add_rms_norm"](
        x.clone(), residual.clone(), weight, EPS
    )
    res = residual.clone()
    normed, _ = fused.rms_norm_row_max(x, weight, EPS, res)
    assert torch.equal(res, expected_residual)
    _within_two_ulps(normed, expected)
    gate_up = _rows(m, 2 * INTERMEDIATE, torch.bfloat16, 8)
    product, _ = fused.silu_and_mul_row_max(gate_up)
    _within_two_ulps(product, ops.CUSTOM_OPS["silu_and_mul"](gate_up))


def test_fused_kernels_replay_from_a_cuda_graph_as_eager(fused: ModuleType):
    x, residual = _rows(200, HIDDEN, torch.bfloat16, 9), _rows(200, HIDDEN, torch.bfloat16, 10)
    gate_up = _rows(200, 2 * INTERMEDIATE, torch.bfloat16, 11)
    weight = torch.ones(HIDDEN, dtype=torch.bfloat16, device="cuda")
    start, x_first = residual.clone(), x.clone()

    def step() -> list[torch.Tensor]:
        residual.copy_(start)  # the norm adds into it
        outs: list[torch.Tensor] = []
        for mode in ("token", "tensor"):
            outs.extend(fused.rms_norm_quant(x, weight, EPS, mode, FP8, residual))
            outs.extend(fused.silu_and_mul_quant(gate_up, mode, FP8))
        return outs

    eager = [t.clone() for t in step()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x.copy_(x_first.flip(0))
    graph.replay()
    x.copy_(x_first)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager, strict=True):
        assert same_bits(got, want) if got.dtype == FP8 else torch.equal(got, want)


@pytest.mark.parametrize("method", ["fp8", "fp8_per_channel", "fp8_per_block"])
def test_engine_with_fused_input_quantization_agrees_with_the_unfused_engine(
    method, tmp_path, smollm2_tokenizer_dir, monkeypatch
):
    """Teacher-forced over the unfused fp8 engine's own greedy sequences: the fused engine picks
    the same top-1 token almost everywhere (the norm may round a value an ulp apart)."""
    if method == "fp8_per_block":
        pytest.importorskip("pagellm_fp8.kernels.block_gemm")
    from fp8_checkpoints import tiny_llama
    from pagellm_fp8.input_quant import FUSED_INPUT_QUANT_ENV, TritonInputQuantizer

    from pagellm import LLM, SamplingParams
    from pagellm.layers.activation import SiluAndMul
    from pagellm.layers.layernorm import RMSNorm

    path = tiny_llama(tmp_path / "float", smollm2_tokenizer_dir)
    engine = dict(
        dtype="bfloat16", max_model_len=64, kv_cache_memory=1 << 30, seed=0, quantization=method
    )
    prompts = [[5, 6, 7, 8, 9], [40, 41, 300, 12], [700, 3, 18, 19, 20, 21]]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    monkeypatch.setenv(FUSED_INPUT_QUANT_ENV, "0")
    unfused = LLM(str(path), **engine)
    outs = unfused.generate(prompts, greedy, use_tqdm=False)
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    del unfused
    monkeypatch.setenv(FUSED_INPUT_QUANT_ENV, "1")
    llm = LLM(str(path), **engine)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    producers = [m for m in model.modules() if isinstance(m, RMSNorm | SiluAndMul)]
    bound = [p.input_quantizer for p in producers if p.input_quantizer is not None]
    assert len(bound) == 3 * len(model.model.layers)
    assert all(isinstance(q, TritonInputQuantizer) for q in bound)
    forced = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    ranks = [
        o.prompt_logprobs[pos][o.prompt_token_ids[pos]].rank
        for p, o in zip(prompts, llm.generate(seqs, forced, use_tqdm=False), strict=True)
        for pos in range(len(p), len(o.prompt_token_ids))
    ]
    agreement = sum(r == 1 for r in ranks) / len(ranks)
    print(f"{method} fused vs unfused: teacher-forced top-1 {agreement:.1%} of {len(ranks)}")
    assert agreement >= 0.95, (method, agreement)
