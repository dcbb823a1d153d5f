"""pagellm-int4 compiled on a CUDA GPU: both CUDA paths (the CUDA kernels over the fragment
layout; the Triton kernels over the tile layout), each a fused W4A16 GEMM and dequantize + cuBLAS,
against the reference path at Llama-3.1-8B layer shapes, the dequantization kernels bit for bit,
CUDA graph replay identical to eager, and the engine on each path (GPTQ, AWQ, compressed-tensors checkpoints
of our RTN writer) against the bf16 model of the same dequantized weights.
Run with ``pytest -m gpu -s plugins/quantization/int4/tests/test_int4_gpu.py``; timings belong
to benchmarks/int4_gemm.py."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from pagellm_int4.fragment_layout import FragmentLayout, to_fragment_layout
from pagellm_int4.int4_values import Int4Values
from pagellm_int4.kernel_layout import KernelLayout, dequantize, to_kernel_layout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 would not compile"
    ),
]


@functools.cache
def _values(k: int, n: int, group: int, act_order: bool) -> Int4Values:
    """Random 4-bit weights on the GPU, one set per shape."""
    g = torch.Generator().manual_seed(0)
    groups = k // group
    values = Int4Values(
        q=torch.randint(0, 16, (k, n), generator=g, dtype=torch.uint8),
        zeros=torch.randint(0, 17, (groups, n), generator=g, dtype=torch.uint8),
        scales=torch.rand(groups, n, generator=g) * 0.01 + 0.001,
        g_idx=(torch.randperm(k, generator=g) % groups) if act_order else torch.arange(k) // group,
    )
    return Int4Values(
        q=values.q.cuda(),
        zeros=values.zeros.cuda(),
        scales=values.scales.cuda(),
        g_idx=values.g_idx.cuda(),
    )


@functools.cache
def _layout(k: int, n: int, group: int, act_order: bool) -> KernelLayout:
    return to_kernel_layout(_values(k, n, group, act_order), group, "test")


@functools.cache
def _fragments(k: int, n: int, group: int, act_order: bool) -> FragmentLayout:
    return to_fragment_layout(_values(k, n, group, act_order), group, "test")


def _cuda_kernels():
    from pagellm_int4.gemm import cuda_kernels_or_reason

    kernels = cuda_kernels_or_reason(torch.device("cuda"))
    assert not isinstance(kernels, str), f"the CUDA int4 kernels do not run here: {kernels}"
    return kernels


def _close_to_reference(out: torch.Tensor, expected: torch.Tensor, what: object) -> None:
    # The fused kernels multiply the exact codes and scales once per group; dequantize + mm
    # rounds every weight to dtype first (a relative 2^-9 each for bf16, summed over K): an
    # output near zero can then miss by a few hundredths of the typical output.
    scale = expected.abs().mean().item()
    rel = ((out.float() - expected).norm() / expected.norm()).item()
    assert rel < 5e-3, (what, rel)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=4e-2 * scale)


SHAPES = [
    (6144, 4096, 128, False),
    (4096, 14336, 128, True),
    (1000, 4096, 4096, False),  # one group (-1), N not a multiple of the N tile
    (4096, 4096, 32, False),
]


@pytest.mark.parametrize("m", [1, 7, 16, 64, 65, 300, 1024])
@pytest.mark.parametrize(("n", "k", "group", "act_order"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_paths_match_the_reference_path(m, n, k, group, act_order, dtype):
    from pagellm_int4.gemm import FUSED_MAX_M, _triton_gemm, reference_gemm, triton_kernels

    layout = _layout(k, n, group, act_order)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    out = _triton_gemm(triton_kernels())(x, layout)
    assert out.shape == (m, n) and out.dtype == dtype
    _close_to_reference(out, reference_gemm(x.float(), layout), (m, n, k, group))
    if m <= FUSED_MAX_M:
        from pagellm_int4.kernels.w4a16 import w4a16_gemm

        a = x if layout.perm is None else x[:, layout.perm]
        fused = w4a16_gemm(a, layout.qweight, layout.scales, layout.zeros, group)
        assert torch.equal(fused, out)


@pytest.mark.parametrize("m", [1, 7, 8, 9, 16, 17, 40, 64, 65, 300])
@pytest.mark.parametrize(("n", "k", "group", "act_order"), [*SHAPES, (4160, 2048, 64, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_paths_match_the_reference_path(m, n, k, group, act_order, dtype):
    """The CUDA kernels (``cuda_mma``): the tensor-core GEMM in launches of 16 rows up to
    CUDA_FUSED_MAX_M, the transposed dequantization + cuBLAS above."""
    from pagellm_int4.gemm import choose_gemm, reference_gemm

    gemm = choose_gemm(torch.device("cuda"), k, group)
    assert gemm.name == "cuda_mma"
    fragments = _fragments(k, n, group, act_order)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    out = gemm.run(x, fragments)
    assert out.shape == (m, n) and out.dtype == dtype
    _close_to_reference(out, reference_gemm(x.float(), _layout(k, n, group, act_order)), (m, n))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_dequantization_is_the_reference_bit_for_bit(dtype):
    kernels = _cuda_kernels()
    for k, n, group in [(4096, 6144, 128), (208, 1000, 16), (4096, 1000, 4096)]:
        expected = dequantize(_layout(k, n, group, False), dtype).t()
        for staged in (False, True):
            out = kernels.dequantize_t(_fragments(k, n, group, False), dtype, staged)
            assert torch.equal(out, expected), (k, n, group, staged)


@pytest.mark.parametrize(
    ("warps", "splits", "depth", "x_depth", "m", "group"),
    [
        (4, 1, 4, None, 12, 128),
        (8, 4, 8, None, 12, 128),
        (2, 7, 4, None, 12, 128),
        (8, 64, 8, None, 12, 128),
        (4, 3, 8, 2, 12, 128),  # x two steps ahead, 16 rows
        (8, 1, 8, 2, 16, 64),
        (16, 2, 8, 2, 5, 128),  # blocks of 16 warps, 8 rows
        (16, 1, 8, None, 8, 64),
        (16, 5, 4, None, 1, 128),
        (4, 4, 8, (None, 16), 1, 128),  # an L2 prefetch 16 steps ahead (padding read)
        (8, 1, 8, (2, 16), 16, 64),
    ],
)
def test_cuda_gemm_launch_shapes_agree_and_replay_in_graphs(
    warps, splits, depth, x_depth, m, group
):
    """Warps a block (up to 16 for 8 rows), splits a strip (uneven ones; more than there are
    steps), steps of weights and of x loaded ahead, each run against the reference, identical
    over graph replays, the split counters back at zero."""
    from pagellm_int4.cuda.kernels import MmaConfig
    from pagellm_int4.gemm import reference_gemm

    kernels = _cuda_kernels()
    fragments = _fragments(4096, 6144, group, False)
    x_depth, prefetch = x_depth if isinstance(x_depth, tuple) else (x_depth, 0)
    cfg = MmaConfig(warps, splits, depth, x_depth, prefetch)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    eager = kernels.gemm(x, fragments, cfg)
    _close_to_reference(eager, reference_gemm(x.float(), _layout(4096, 6144, group, False)), cfg)
    assert torch.equal(kernels.gemm(x, fragments, cfg), eager)  # deterministic sums
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [kernels.gemm(x, fragments, cfg) for _ in range(4)]
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(out, eager) for out in outs)
    assert not bool(kernels._counters.any())


def test_cuda_gemm_with_programmatic_dependent_launch_is_the_same_eager_and_in_graphs():
    """Launched with programmatic dependent launch (sm_90+; the GEMM's first weight loads
    overlap the kernel before it, which writes its x here), each result is bit for bit the
    plain launch's, eager and over graph replays, 16-row launches back to back included."""
    from pagellm_int4.cuda.kernels import MmaConfig

    kernels = _cuda_kernels()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    fragments = _fragments(4096, 6144, 128, False)
    base = torch.randn(40, 4096, device="cuda", dtype=torch.bfloat16)
    configs = [None, MmaConfig(4, 3, 8, 2), MmaConfig(16, 2, 8)]

    def run() -> list[torch.Tensor]:
        outs = []
        for i, cfg in enumerate(configs):
            x = base * (i + 1)  # written by the kernel just before the GEMM
            outs.append(kernels.gemm(x[: 40 if cfg is None else 8], fragments, cfg))
        return outs

    kernels.overlap = False
    plain = run()
    kernels.overlap = True
    try:
        eager = run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    finally:
        kernels.overlap = False
    for a, b, c in zip(plain, eager, captured, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert not bool(kernels._counters.any())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_kernel_is_the_reference_bit_for_bit(dtype):
    from pagellm_int4.kernels.w4a16 import dequantize_int4

    for k, n, group in [(4096, 6144, 128), (200, 1000, 40)]:
        layout = _layout(k, n, group, act_order=False)
        out = dequantize_int4(layout.qweight, layout.scales, layout.zeros, group, k, dtype)
        assert torch.equal(out, dequantize(layout, dtype))


def test_graph_replay_of_the_fused_gemm_is_identical_to_eager():
    from pagellm_int4.kernels.w4a16 import w4a16_gemm

    layout = _layout(4096, 4096, 128, act_order=False)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)

    def run() -> torch.Tensor:
        return w4a16_gemm(x, layout.qweight, layout.scales, layout.zeros, 128)

    eager = run()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, run())
    assert not torch.equal(captured, eager)


@pytest.mark.parametrize("split_k", [2, 5, 7, 32])
def test_split_k_sums_are_the_same_bits_by_the_last_program_or_a_second_kernel(split_k):
    """Even and uneven splits of K = 4096's 32 tiles; the serial sum (a counter per output tile,
    re-armed by the last program) over many graph replays equals the two-launch sum."""
    import dataclasses

    from pagellm_int4.gemm import reference_gemm
    from pagellm_int4.kernels import tiles as int4_tiles
    from pagellm_int4.kernels.split_k import tile_counters
    from pagellm_int4.kernels.w4a16 import w4a16_gemm

    layout = _layout(4096, 6144, 128, act_order=False)
    x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    serial = int4_tiles.TileConfig("dot", 16, 128, 128, split_k, 4, 3)
    second = dataclasses.replace(serial, reduce="kernel")

    def run(tiles: int4_tiles.TileConfig) -> torch.Tensor:
        return w4a16_gemm(x, layout.qweight, layout.scales, layout.zeros, 128, tiles=tiles)

    expected = run(second)
    assert torch.equal(run(serial), expected)
    ref = reference_gemm(x.float(), layout)
    assert ((expected.float() - ref).norm() / ref.norm()).item() < 5e-3
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run(serial)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [run(serial) for _ in range(8)]  # eight launches back to back, one counter set
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(out, expected) for out in outs)
    assert not bool(tile_counters(x.device, 1).any())


@pytest.mark.parametrize("variant", ["dot_t", "chains2", "fma", "fma_shift"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("block_n", "warps", "split_k"), [(64, 4, 1), (128, 4, 4), (256, 8, 3)])
def test_kernel_variants_match_the_dot_kind(block_n, warps, split_k, dtype, variant):
    """``dot_t`` (out^T = W^T x^T, the unpacked weights as the MMA's A operand), ``dot`` with
    two MMA chains a tile and ``fma`` (CUDA cores, 4 rows a program; the inline PTX unpack, or
    Triton ops), against ``dot`` on the same tiles, at M = 1 and 16 and N not a multiple of
    every tile."""
    from pagellm_int4.gemm import reference_gemm
    from pagellm_int4.kernels import tiles as int4_tiles
    from pagellm_int4.kernels.w4a16 import w4a16_gemm

    layout = _layout(4096, 1000, 128, act_order=False)
    dot = int4_tiles.TileConfig("dot", 16, block_n, 128, split_k, warps, 3)
    if variant == "dot_t":
        other = int4_tiles.TileConfig("dot_t", 16, block_n, 128, split_k, warps, 3)
    elif variant.startswith("fma"):
        unpack = "shift" if variant == "fma_shift" else "asm"
        other = int4_tiles.TileConfig("fma", 4, block_n, 128, split_k, warps, 3, unpack=unpack)
    else:
        other = int4_tiles.TileConfig("dot", 16, block_n, 128, split_k, warps, 3, chains=2)
    for m in (1, 16):
        x = torch.randn(m, 4096, device="cuda", dtype=dtype)
        args = (x, layout.qweight, layout.scales, layout.zeros, 128)
        a, b = w4a16_gemm(*args, tiles=dot), w4a16_gemm(*args, tiles=other)
        ref = reference_gemm(x.float(), layout)
        for out in (a, b):
            assert ((out.float() - ref).norm() / ref.norm()).item() < 5e-3
        torch.testing.assert_close(b.float(), a.float(), rtol=1e-2, atol=1e-2 * ref.abs().mean())


@pytest.mark.parametrize("kernels", ["cuda", "triton"])
@pytest.mark.parametrize(
    "scheme_args",
    [
        ("gptq", 128, True, False),
        ("gptq", 64, False, True),
        ("awq", 128, False, False),
        ("compressed-tensors", 128, True, False),
    ],
    ids=["gptq_sym", "gptq_asym_desc_act", "awq", "compressed_tensors"],
)
def test_engine_on_the_gpu_agrees_with_the_bf16_model_of_the_same_weights(
    scheme_args, kernels, tmp_path, smollm2_tokenizer_dir, monkeypatch
):
    from int4_checkpoints import (
        awq_unpack,
        compressed_tensors_unpack,
        dense_checkpoint,
        gptq_unpack,
        tiny_llama,
    )
    from pagellm_int4.rtn import write_checkpoint
    from pagellm_int4.scheme import Int4Scheme

    from pagellm import LLM, SamplingParams
    from pagellm.layers.linear import Linear

    fmt, group, sym, desc_act = scheme_args
    scheme = Int4Scheme(fmt, group, sym=sym, desc_act=desc_act)
    source = tiny_llama(tmp_path / "float", smollm2_tokenizer_dir)
    quantized = write_checkpoint(source, tmp_path / "int4", scheme)
    if fmt == "compressed-tensors":
        unpack = compressed_tensors_unpack(scheme)
    elif fmt == "gptq":
        unpack = lambda t: gptq_unpack(t, True)  # noqa: E731
    else:
        unpack = lambda t: awq_unpack(t, group)  # noqa: E731
    dense_path = dense_checkpoint(source, quantized, tmp_path / "dense", unpack)
    engine = dict(dtype="bfloat16", max_model_len=128, kv_cache_memory=1 << 30, seed=0)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 300, 12], [700, 3, 18, 19, 20, 21]]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    dense = LLM(str(dense_path), enforce_eager=True, **engine)
    seqs = [
        p + list(o.outputs[0].token_ids)
        for p, o in zip(prompts, dense.generate(prompts, greedy, use_tqdm=False), strict=True)
    ]
    del dense
    from pagellm_int4.gemm import cuda_kernels_or_reason

    monkeypatch.setenv("PAGELLM_INT4_KERNELS", kernels)
    cuda_kernels_or_reason.cache_clear()
    llm = LLM(str(quantized), **engine)  # CUDA graphs on: decode replays the fused kernel
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    paths = {m.linear_method.gemm_path for m in model.modules() if isinstance(m, Linear)}
    assert paths == {f"{kernels}_mma" if kernels == "cuda" else "triton_w4a16"}, paths
    generated = llm.generate(prompts, greedy, use_tqdm=False)
    forced = llm.generate(
        seqs, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False
    )
    ranks = [
        o.prompt_logprobs[pos][o.prompt_token_ids[pos]].rank
        for p, o in zip(prompts, forced, strict=True)
        for pos in range(len(p), len(o.prompt_token_ids))
    ]
    agreement = sum(r == 1 for r in ranks) / len(ranks)
    same = sum(
        a == b
        for s, p, o in zip(seqs, prompts, generated, strict=True)
        for a, b in zip(s[len(p) :], o.outputs[0].token_ids, strict=True)
    )
    print(
        f"{fmt} on the GPU vs bf16 of the same weights: teacher-forced top-1 {agreement:.1%} "
        f"over {len(ranks)} positions; free-running greedy tokens equal {same}/{len(ranks)}"
    )
    assert agreement >= 0.98, (fmt, agreement)
