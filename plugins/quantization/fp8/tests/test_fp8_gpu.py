"""pagellm-fp8's CUDA GEMM paths against its reference path (the same quantized operands,
dequantized and multiplied in float32), and the engine's parity with the bf16 model on the GPU.
Needs a GPU of compute capability >= 8.9 (H200 here): `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch
from pagellm_fp8.gemm import choose_gemm, reference_gemm
from pagellm_fp8.quant_ops import quantize_weight
from pagellm_fp8.scheme import Fp8Scheme

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA GPU of compute capability 8.9 or newer",
    ),
]

SCHEMES = {
    "tensor": (Fp8Scheme("tensor", "tensor"), "scaled_mm_tensor"),
    "static_tensor": (Fp8Scheme("tensor", "tensor", static_activations=True), "scaled_mm_tensor"),
    "channel": (Fp8Scheme("channel", "token"), "scaled_mm_rowwise"),
    "block": (Fp8Scheme("block", "group"), "block_scaled_mm"),
}


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("m", [1, 16, 200, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_gemm_matches_the_reference_path(name, m, dtype):
    scheme, expected_path = SCHEMES[name]
    if expected_path == "block_scaled_mm":
        pytest.importorskip("pagellm_fp8.kernels.block_gemm")
    torch.manual_seed(0)
    k, n = 1024, 768
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda") * 0.02
    q, scale = quantize_weight(w, scheme.weights)
    input_scale = (x.abs().amax().float() / 448).reshape(1) if scheme.static_activations else None
    path, gemm = choose_gemm(scheme, x.device)
    assert path == expected_path
    out = gemm(x, q, scale, input_scale)
    assert out.dtype == dtype and out.shape == (m, n)
    expected = reference_gemm(scheme)(x.float(), q, scale, input_scale)
    # Same quantized operands; only accumulation order and the output rounding differ.
    torch.testing.assert_close(
        out.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().mean().item()
    )


@pytest.mark.parametrize("m", [1, 200, 256, 300])  # 300: past the skinny GEMM, _scaled_mm
def test_skinny_gemm_opt_in_matches_scaled_mm(m, monkeypatch):
    """``PAGELLM_FP8_SKINNY_GEMM=1``: per-tensor layers of up to 256 tokens take the skinny
    GEMM; the result is _scaled_mm's up to accumulation order and the output rounding."""
    from pagellm_fp8 import gemm as gemm_module

    torch.manual_seed(0)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    q, scale = quantize_weight(torch.randn(768, 1024, device="cuda") * 0.02, "tensor")
    scheme = Fp8Scheme("tensor", "tensor")
    plain = gemm_module._scaled_mm_tensor(scheme)(x, q, scale, None)
    monkeypatch.setenv(gemm_module.SKINNY_ENV, "1")
    skinny = gemm_module._scaled_mm_tensor(scheme)(x, q, scale, None)
    assert skinny.dtype == plain.dtype and skinny.shape == plain.shape
    torch.testing.assert_close(
        skinny.float(), plain.float(), rtol=2e-2, atol=2e-2 * plain.float().abs().mean().item()
    )


def test_fast_accumulation_default_matches_promoted_scaled_mm(monkeypatch):
    from pagellm_fp8 import gemm as gemm_module

    torch.manual_seed(0)
    x = torch.randn(200, 4096, device="cuda", dtype=torch.bfloat16)
    q, scale = quantize_weight(torch.randn(1024, 4096, device="cuda") * 0.02, "tensor")
    scheme = Fp8Scheme("tensor", "tensor")
    monkeypatch.setenv(gemm_module.FAST_ACCUM_ENV, "0")
    plain = gemm_module._scaled_mm_tensor(scheme)(x, q, scale, None)
    monkeypatch.delenv(gemm_module.FAST_ACCUM_ENV)
    fast = gemm_module._scaled_mm_tensor(scheme)(x, q, scale, None)
    rel = ((fast.float() - plain.float()).norm() / plain.float().norm()).item()
    print(f"fast accumulation against promoted, K = 4096: relative difference {rel:.2e}")
    assert rel < 1e-2


def test_rowwise_epilogue_path_of_capability_8_9_matches_the_native_one():
    """Ada has no row-wise _scaled_mm: its path (unit scales, float32, scales after) is checked
    here against the native one, on this Hopper GPU."""
    from pagellm_fp8 import gemm as gemm_module

    torch.manual_seed(0)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    q, scale = quantize_weight(torch.randn(256, 512, device="cuda") * 0.02, "channel")
    scheme = Fp8Scheme("channel", "token")
    native = gemm_module._scaled_mm_rowwise(scheme, native=True)(x, q, scale, None)
    epilogue = gemm_module._scaled_mm_rowwise(scheme, native=False)(x, q, scale, None)
    torch.testing.assert_close(native.float(), epilogue.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("method", ["fp8", "fp8_per_channel", "fp8_per_block"])
def test_engine_on_the_gpu_agrees_with_the_bf16_model(method, tmp_path, smollm2_tokenizer_dir):
    if method == "fp8_per_block":
        pytest.importorskip("pagellm_fp8.kernels.block_gemm")
    from fp8_checkpoints import tiny_llama

    from pagellm import LLM, SamplingParams
    from pagellm.layers.linear import Linear

    path = tiny_llama(tmp_path / "float", smollm2_tokenizer_dir)
    engine = dict(dtype="bfloat16", max_model_len=64, kv_cache_memory=1 << 30, seed=0)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 300, 12], [700, 3, 18, 19, 20, 21]]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    dense = LLM(str(path), enforce_eager=True, **engine)
    seqs = [
        p + list(o.outputs[0].token_ids)
        for p, o in zip(prompts, dense.generate(prompts, greedy, use_tqdm=False), strict=True)
    ]
    forced = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    dense_outs = dense.generate(seqs, forced, use_tqdm=False)
    del dense
    llm = LLM(str(path), quantization=method, **engine)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    paths = {m.linear_method.gemm_path for m in model.modules() if isinstance(m, Linear)}
    assert "reference" not in paths, paths
    outs = llm.generate(seqs, forced, use_tqdm=False)
    ranks, gaps = [], []
    for p, o, d in zip(prompts, outs, dense_outs, strict=True):
        for pos in range(len(p), len(o.prompt_token_ids)):
            token = o.prompt_token_ids[pos]
            ranks.append(o.prompt_logprobs[pos][token].rank)
            gaps.append(
                abs(o.prompt_logprobs[pos][token].logprob - d.prompt_logprobs[pos][token].logprob)
            )
    agreement = sum(r == 1 for r in ranks) / len(ranks)
    print(
        f"{method} on the GPU vs the bf16 model: teacher-forced top-1 {agreement:.1%} over "
        f"{len(ranks)} positions, logprob gap mean {sum(gaps) / len(gaps):.4f} max {max(gaps):.4f}"
    )
    assert agreement >= 0.9, (method, agreement)
