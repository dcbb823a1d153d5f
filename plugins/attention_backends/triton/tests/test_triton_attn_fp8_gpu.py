"""TRITON_ATTN with an FP8 (e4m3) KV cache on a CUDA GPU at serving sizes: the write kernel
against `quantize_kv` bit for bit, the attention kernels against a float32 reference over the
quantized K/V, and the engine end to end against the bf16 cache.

Run on the device machine with ``pytest -m gpu plugins/attention_backends/triton/tests``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_triton_attn_gpu import (
    BLOCK_SIZE,
    DTYPES,
    Batch,
    assert_matches_reference,
    auto_splits,
    make_batch,
    pkg,  # noqa: F401 (fixture)
    poisoned,
    random_decode_rows,
    reference,
    run_decode,
    run_mixed,
    swapped_tiles,
)

from pagellm.kv_cache.fp8 import FP8_KV_DTYPE, dequantize_kv, quantize_kv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
        reason="FP8 needs compute capability >= 8.9",
    ),
]

# Keys reach 448 * scale (saturation) at |x| = 4: a handful of randn entries saturate.
K_SCALE, V_SCALE = 4.0 / 448, 3.0 / 448


def fp8_batch(kernels, batch: Batch) -> Batch:
    """The same step with an FP8 cache: context quantized, the reference over the dequantized
    values. The keys' NaN poison stays NaN; the values' becomes 448, the largest finite value
    (an FP8 cache never holds a NaN, and the kernels load value tiles unmasked)."""
    cache = torch.empty_like(batch.kv_cache, dtype=FP8_KV_DTYPE)
    key_cache, value_cache = kernels.split_kv_cache(cache)
    key_cache.copy_(quantize_kv(batch.kv_cache[0], K_SCALE))
    value_cache.copy_(quantize_kv(batch.kv_cache[1].nan_to_num(448 * V_SCALE), V_SCALE))
    return dataclasses.replace(
        batch,
        kv_cache=cache,
        keys=dequantize_kv(quantize_kv(batch.keys, K_SCALE), K_SCALE, torch.float32),
        values=dequantize_kv(quantize_kv(batch.values, V_SCALE), V_SCALE, torch.float32),
    )


def write_fp8(kernels, batch: Batch) -> None:
    kernels.write_kv_cache(
        batch.key,
        batch.value,
        *kernels.split_kv_cache(batch.kv_cache),
        batch.slot_mapping,
        K_SCALE,
        V_SCALE,
    )


def test_fp8_write_quantizes_as_quantize_kv_bit_for_bit(pkg):  # noqa: F811
    kernels, _ = pkg
    batch = fp8_batch(
        kernels,
        make_batch(
            [(1000, 300), (0, 2000), (77, 1)],
            num_heads=32,
            num_kv_heads=8,
            head_size=128,
            dtype=torch.bfloat16,
            padding_rows=5,
        ),
    )
    write_fp8(kernels, batch)
    live = batch.slot_mapping >= 0
    slots = batch.slot_mapping[live]
    caches = kernels.split_kv_cache(batch.kv_cache)
    for i, scale in enumerate((K_SCALE, V_SCALE)):
        stored = caches[i][slots // BLOCK_SIZE, :, slots % BLOCK_SIZE]
        expected = quantize_kv((batch.key, batch.value)[i][live], scale)
        assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize(
    "dtype, head_size, num_heads, num_kv_heads, window",
    [("bf16", 128, 32, 8, None), ("fp16", 64, 16, 8, 1000), ("fp32", 128, 16, 8, None)],
)
def test_fp8_mixed_batch_matches_reference(pkg, dtype, head_size, num_heads, num_kv_heads, window):  # noqa: F811
    kernels, _ = pkg
    rows = [(0, 2048), (3000, 512), (6900, 1200), (0, 37), (8000, 1)]
    rows += random_decode_rows(100, 8192, seed=head_size)
    batch = fp8_batch(
        kernels,
        make_batch(
            rows,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=DTYPES[dtype],
        ),
    )
    scale = head_size**-0.5
    write_fp8(kernels, batch)
    out = poisoned(batch)
    run_mixed(kernels, batch, scale, window, out, k_scale=K_SCALE, v_scale=V_SCALE)
    assert_matches_reference(out, batch, scale, window)


@pytest.mark.parametrize("num_rows, max_context", [(256, 4096), (4, 32768)])
def test_fp8_decode_matches_reference_split_or_not(pkg, num_rows, max_context):  # noqa: F811
    kernels, backend = pkg
    rows = random_decode_rows(num_rows, max_context, seed=num_rows)
    batch = fp8_batch(
        kernels,
        make_batch(
            rows, num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, padding_rows=3
        ),
    )
    write_fp8(kernels, batch)
    splits = auto_splits(kernels, backend, batch.num_reqs, 8, max_context)
    out = poisoned(batch)
    run_decode(kernels, batch, 128**-0.5, None, out, splits, k_scale=K_SCALE, v_scale=V_SCALE)
    assert_matches_reference(out, batch, 128**-0.5, None)


@pytest.mark.parametrize("fp8_mma", [False, True])
@pytest.mark.parametrize("num_splits", [1, 5])
def test_fp8_swapped_decode_matches_reference(pkg, fp8_mma, num_splits):  # noqa: F811
    """`Tiles.swap_ab` over an FP8 cache matches the reference as the default kernel does; with
    `Tiles.fp8_mma` (queries and weights in e4m3 too) within 5 % of the largest output."""
    kernels, _ = pkg
    batch = fp8_batch(
        kernels,
        make_batch(
            random_decode_rows(256, 4096, seed=5), num_heads=32, num_kv_heads=8, head_size=128,
            dtype=torch.bfloat16, padding_rows=3,
        ),
    )  # fmt: skip
    write_fp8(kernels, batch)
    out = poisoned(batch)
    tiles = swapped_tiles(128, fp8_mma=fp8_mma)
    run_decode(
        kernels, batch, 128**-0.5, None, out, num_splits, k_scale=K_SCALE, v_scale=V_SCALE,
        tiles=tiles,
    )  # fmt: skip
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:])), "padding rows must give zeros"
    if not fp8_mma:
        assert_matches_reference(out, batch, 128**-0.5, None)
        return
    expected = reference(batch, 128**-0.5, None)[:-3]
    largest = expected.abs().max().item()
    error = (out[:-3].float() - expected).abs().max().item()
    print(f"\nFP8 products: max error {error:.4f}, outputs up to {largest:.4f}")
    assert error < 0.05 * largest


DECISIVE = 0.1
"""A top-1 lead (in logprob) past which a prediction is not a near-tie."""


def test_fp8_cache_end_to_end_agrees_with_the_bf16_cache(tiny_models):
    """Teacher-forced top-1 over the bf16-cache run's greedy continuations, decode graphs on,
    and twice the KV tokens. A random tiny model's predictions are often near-ties (its top two
    logprobs a few hundredths apart), which any rounding may flip: >= 95 % agreement is asked
    where the bf16 run's top-1 leads by at least 0.1 (``DECISIVE``), >= 90 % everywhere."""
    from pagellm import LLM, SamplingParams

    prompts = [
        [(7 * i + 3 * j) % 1000 + 3 for j in range(n)] for i, n in enumerate((5, 19, 33, 48))
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    forced = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    top1, margins, capacity = {}, [], {}
    sequences: list[list[int]] = []
    for kv in ("auto", "fp8"):
        llm = LLM(
            tiny_models["llama3"],
            dtype="bfloat16",
            max_model_len=256,
            kv_cache_memory=64 << 20,
            attention_backend="TRITON_ATTN",
            kv_cache_dtype=kv,
            long_prefill_token_threshold=16,
        )
        core = llm.llm_engine.core_client
        # In tokens: an FP8 cache defaults to 64-slot pages, a bf16 one to 16.
        capacity[kv] = core.kv_cache_manager.block_pool.num_blocks * core.config.cache.block_size
        assert core.config.cache.block_size == (64 if kv == "fp8" else 16)
        if kv == "auto":
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            sequences = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)]
        outs = llm.generate(sequences, forced, use_tqdm=False)
        positions = [
            pos for o, p in zip(outs, prompts, strict=True) for pos in o.prompt_logprobs[len(p) :]
        ]
        top1[kv] = [next(t for t, lp in pos.items() if lp.rank == 1) for pos in positions]
        if kv == "auto":
            margins = [
                lps[0] - lps[1]
                for lps in (
                    sorted((lp.logprob for lp in pos.values()), reverse=True) for pos in positions
                )
            ]
        del llm
    same = [a == b for a, b in zip(top1["auto"], top1["fp8"], strict=True)]
    decisive = [ok for ok, margin in zip(same, margins, strict=True) if margin >= DECISIVE]
    agreement, decisive_agreement = sum(same) / len(same), sum(decisive) / len(decisive)
    print(
        f"TRITON_ATTN fp8 vs bf16 KV cache: teacher-forced top-1 {agreement:.1%} of {len(same)} "
        f"positions, {decisive_agreement:.1%} of the {len(decisive)} where bf16's top-1 leads by "
        f">= {DECISIVE}"
    )
    assert decisive_agreement >= 0.95 and agreement >= 0.90
    assert capacity["fp8"] == 2 * capacity["auto"]
