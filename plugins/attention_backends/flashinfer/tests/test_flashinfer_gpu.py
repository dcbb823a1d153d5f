"""FLASHINFER with the real FlashInfer on a CUDA GPU: the builder and attention layer at serving
sizes against a float32 torch reference (prompts, chunks after cached context up to 8k, mixed
steps with 200 decodes, 256 decode rows, split-KV rows of 16k, partial last pages, block sizes
16/32/64, head sizes 64/128/256, GQA 2:1 to 8:1 and MQA, a sliding window, bf16 and fp16); decode
replayed from a CUDA graph, identical to the same plan run eagerly; greedy generation of tiny
models against TRITON_ATTN (teacher-forced) and with graphs against eager; and kernel timings
(printed, not asserted: speed belongs to benchmarks).

Run on the device machine with ``pytest -m gpu -s plugins/attention_backends/flashinfer/tests``.
The kernel modules the tests use (and those tests/e2e/test_gpu_models.py's bf16 models need,
which the CUDA platform then runs on FLASHINFER) are compiled first, together, in one parallel
ninja run: minutes with an empty JIT cache, so run this file before the others, and set
``FLASHINFER_WORKSPACE_BASE`` to a directory that outlives the run to reuse them.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import logging
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from pagellm_flashinfer.triton_decode import DECODE_KERNELS, DECODE_VAR

from pagellm.attention.backend import CommonAttentionMetadata
from pagellm.kv_cache.spec import KVCacheSpec
from pagellm.testing.greedy import chosen_logprobs, count_identical_with_near_ties, greedy_run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed"
    ),
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Against float32: the kernels round probabilities to the input dtype before P @ V.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
# (dtype, head size, query heads, KV heads, sliding window): Qwen3-0.6B, Llama-3.1-8B, and more.
# Three kernel specialisations (dtype, head size, window) in all, to keep compilation short.
CONFIGS = [
    ("bf16", 128, 16, 8, None),
    ("bf16", 128, 32, 4, None),
    ("bf16", 64, 32, 8, None),
    ("bf16", 64, 8, 1, None),
    ("fp16", 256, 16, 4, 1000),
    ("fp16", 256, 8, 8, 1000),
]


@pytest.fixture(scope="module", autouse=True)
def compiled() -> None:
    """Every kernel module the tests use, built as the builder builds them (each by its own
    ninja file; ``-s`` shows how long it took)."""
    import flashinfer
    from pagellm_flashinfer.availability import flashinfer_unavailable_reason
    from pagellm_flashinfer.jit_cache import (
        DecodeModule,
        cache_dir,
        compile_missing,
        modules_for,
    )
    from pagellm_flashinfer.planning import prefill_backend

    reason = flashinfer_unavailable_reason()
    if reason is not None:
        pytest.fail(f"FLASHINFER is unavailable on this GPU machine: {reason}")
    major, minor = torch.cuda.get_device_capability()
    backend = prefill_backend((major, minor), torch.version.cuda)
    specs = {(DTYPES[d], head, window is not None) for d, head, _, _, window in CONFIGS}
    # With flashinfer installed, the CUDA platform picks FLASHINFER for the bf16 models of
    # tests/e2e/test_gpu_models.py too; its Mistral (head 64, a window) is the one more kind.
    specs.add((torch.bfloat16, 64, True))
    modules: list = [m for spec in sorted(specs, key=str) for m in modules_for(backend, *spec)]
    # The CUDA-core decode kernels, timed against the tensor-core ones.
    modules.append(DecodeModule(torch.bfloat16, 128, False))
    started = time.perf_counter()
    built = compile_missing(flashinfer, modules)
    print(
        f"\nFlashInfer {flashinfer.__version__}, prefill backend {backend}: compiled {built} of "
        f"{len(modules)} kernel modules in {time.perf_counter() - started:.1f} s ({cache_dir(flashinfer)})"
    )


@pytest.fixture(autouse=True)
def exact_float32_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    # The reference must not run its float32 matmuls in TF32.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@pytest.fixture(autouse=True)
def flashinfer_decode_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashInfer's decode wrapper unless a test asks for TRITON_ATTN's kernel (the CUDA default
    of an engine: tests/e2e/test_gpu_models.py runs it), so that these tests cover the wrapper."""
    monkeypatch.setenv(DECODE_VAR, "flashinfer")


# ---------------------------------------------------------------------------- batches


@dataclass
class Batch:
    """A step on the GPU: the context before the step is in the cache, the new tokens' K/V in
    ``key``/``value``. Blocks no row owns hold NaN; the tails of rows' last pages hold finite
    junk, as stale slots do in a running engine."""

    query: torch.Tensor  # [T, H, D], a column slice of a fused QKV projection
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    common: CommonAttentionMetadata
    keys: torch.Tensor  # every real row's whole sequence, concatenated: [sum(seq_lens), Hkv, D]
    values: torch.Tensor
    rows: list[tuple[int, int]]  # (context, new tokens); padding rows are (0, 1), seq_len 0
    num_padding: int

    @property
    def num_tokens(self) -> int:
        return self.query.shape[0]

    def kv_bytes(self) -> int:
        """Bytes of K and V one attention pass over the batch reads (each once)."""
        return 2 * self.keys.numel() * self.keys.element_size()

    def flat(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.num_tokens
        return self.query.reshape(n, -1), self.key.reshape(n, -1), self.value.reshape(n, -1)


def make_batch(
    rows: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    block_size: int = 16,
    padding_rows: int = 0,
    seed: int = 0,
) -> Batch:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    contexts = torch.tensor([c for c, _ in rows] + [0] * padding_rows, device=dev)
    new = torch.tensor([n for _, n in rows] + [1] * padding_rows, device=dev)
    seq_lens = contexts + new
    seq_lens[len(rows) :] = 0
    num_rows = len(rows) + padding_rows
    blocks = (seq_lens + block_size - 1) // block_size
    total_blocks = int(blocks.sum())
    num_blocks = total_blocks + 9  # the null block 0 and a few never used
    shuffled = torch.randperm(num_blocks - 1, device=dev, generator=gen) + 1
    block_table = torch.zeros(num_rows, max(int(blocks.max()), 1), dtype=torch.int32, device=dev)
    row_of_block = torch.repeat_interleave(torch.arange(num_rows, device=dev), blocks)
    col = torch.arange(total_blocks, device=dev) - torch.repeat_interleave(
        torch.cumsum(blocks, 0) - blocks, blocks
    )
    owned = shuffled[:total_blocks]
    block_table[row_of_block, col] = owned.int()

    total = int(seq_lens.sum())
    keys = torch.randn(total, num_kv_heads, head_size, device=dev, generator=gen).to(dtype)
    values = torch.randn(total, num_kv_heads, head_size, device=dev, generator=gen).to(dtype)
    row_of_pos = torch.repeat_interleave(torch.arange(num_rows, device=dev), seq_lens)
    pos = torch.arange(total, device=dev) - torch.repeat_interleave(
        torch.cumsum(seq_lens, 0) - seq_lens, seq_lens
    )
    slots = block_table[row_of_pos, pos // block_size].long() * block_size + pos % block_size
    cached = pos < contexts[row_of_pos]
    shape = (2, num_blocks, block_size, num_kv_heads, head_size)
    kv_cache = torch.randn(shape, device=dev, generator=gen).to(dtype)
    unowned = torch.ones(num_blocks, dtype=torch.bool, device=dev)
    unowned[owned] = False
    kv_cache[:, unowned] = float("nan")
    flat_cache = kv_cache.view(2, -1, num_kv_heads, head_size)
    flat_cache[0, slots[cached]] = keys[cached]
    flat_cache[1, slots[cached]] = values[cached]

    def pad(x: torch.Tensor) -> torch.Tensor:
        extra = torch.randn(padding_rows, *x.shape[1:], device=dev, generator=gen).to(dtype)
        return torch.cat([x, extra])

    slot_mapping = torch.cat([slots[~cached], torch.full((padding_rows,), -1, device=dev)])
    num_tokens = int(new.sum())
    fused = torch.randn(
        num_tokens, (num_heads + 2 * num_kv_heads) * head_size, device=dev, generator=gen
    ).to(dtype)
    qsl = torch.zeros(num_rows + 1, dtype=torch.int32, device=dev)
    qsl[1:] = torch.cumsum(new, 0)
    seq_lens32 = seq_lens.int()
    common = CommonAttentionMetadata(
        num_reqs=num_rows,
        num_actual_tokens=num_tokens,
        max_query_len=int(new.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.cpu().pin_memory(),
        seq_lens=seq_lens32,
        seq_lens_cpu=seq_lens32.cpu().pin_memory(),
        block_table=block_table,
        slot_mapping=slot_mapping,
    )
    return Batch(
        query=fused[:, : num_heads * head_size].view(num_tokens, num_heads, head_size),
        key=pad(keys[~cached]),
        value=pad(values[~cached]),
        kv_cache=kv_cache,
        common=common,
        keys=keys,
        values=values,
        rows=list(rows) + [(0, 1)] * padding_rows,
        num_padding=padding_rows,
    )


def reference(batch: Batch, scale: float, window: int | None) -> torch.Tensor:
    """Float32 causal attention per row, the query heads grouped by KV head; padding rows give
    zeros. Queries go in chunks so that long prompts fit in memory."""
    num_heads, head_size = batch.query.shape[1:]
    num_kv_heads = batch.keys.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(batch.query.shape, dtype=torch.float32, device="cuda")
    num_real = len(batch.rows) - batch.num_padding
    q_start = k_start = 0
    for row, (ctx, new) in enumerate(batch.rows):
        seq_len = ctx + new if row < num_real else 0
        k = batch.keys[k_start : k_start + seq_len].float()
        v = batch.values[k_start : k_start + seq_len].float()
        for c0 in range(0, new if seq_len else 0, 1024):
            c1 = min(new, c0 + 1024)
            q = batch.query[q_start + c0 : q_start + c1].float()
            q = q.view(c1 - c0, num_kv_heads, group, head_size)
            scores = torch.einsum("qhgd,khd->hgqk", q, k) * scale
            q_pos = torch.arange(ctx + c0, ctx + c1, device="cuda").unsqueeze(1)
            k_pos = torch.arange(seq_len, device="cuda").unsqueeze(0)
            visible = k_pos <= q_pos
            if window is not None:
                visible &= k_pos > q_pos - window
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            o = torch.einsum("hgqk,khd->qhgd", probs, v)
            out[q_start + c0 : q_start + c1] = o.reshape(c1 - c0, num_heads, head_size)
        q_start += new
        k_start += seq_len
    return out


def assert_matches_reference(out: torch.Tensor, batch: Batch, scale: float, window: int | None):
    num_real_tokens = batch.num_tokens - batch.num_padding  # padding rows' outputs are unused
    out = out[:num_real_tokens]
    assert torch.isfinite(out).all(), "some outputs read a slot they should not have"
    tol = TOLERANCE[batch.query.dtype]
    expected = reference(batch, scale, window)[:num_real_tokens]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def assert_new_kv_written(batch: Batch) -> None:
    live = batch.common.slot_mapping >= 0
    slots = batch.common.slot_mapping[live]
    flat = batch.kv_cache.view(2, -1, *batch.kv_cache.shape[3:])
    assert torch.equal(flat[0, slots], batch.key[live])
    assert torch.equal(flat[1, slots], batch.value[live])


def spec_of(batch: Batch, window: int | None) -> KVCacheSpec:
    _, _, block_size, num_kv_heads, head_size = batch.kv_cache.shape
    return KVCacheSpec(block_size, num_kv_heads, head_size, batch.kv_cache.dtype, window)


def make_impl(batch: Batch, window: int | None):
    from pagellm_flashinfer.backend import FlashInferImpl

    num_heads, head_size = batch.query.shape[1:]
    return FlashInferImpl(num_heads, head_size, head_size**-0.5, batch.kv_cache.shape[3], window)


def run_eager(batch: Batch, window: int | None, builder=None):
    """Build, plan and attend as one layer of an eager step; returns (out, metadata, builder)."""
    from pagellm_flashinfer.builder import FlashInferMetadataBuilder

    builder = builder or FlashInferMetadataBuilder(spec_of(batch, window), torch.device("cuda"))
    meta = builder.build(batch.common)
    impl = make_impl(batch, window)
    out = impl.forward(*batch.flat(), batch.kv_cache, meta)
    return out.view(batch.query.shape), meta, builder


def random_decode_rows(n: int, max_context: int, seed: int) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(seed)
    return [(int(c), 1) for c in torch.randint(0, max_context, (n,), generator=gen)]


def batch_for(config, rows, **kwargs) -> tuple[Batch, int | None]:
    dtype, head_size, num_heads, num_kv_heads, window = config
    batch = make_batch(
        rows,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=DTYPES[dtype],
        **kwargs,
    )
    return batch, window


# ---------------------------------------------------------------------------- the layer

MIXED_ROWS = [(0, 2048), (3000, 512), (6900, 1200), (0, 37), (129, 64), (8000, 1)]
PROMPT_ROWS = [(0, 4096), (0, 1), (0, 333), (0, 17)]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("kind", ["prompts", "mixed", "decodes-first"])
def test_prefill_wrapper_matches_reference(config, kind):
    """Prompts alone; prompts, chunks after long cached contexts and 200 decodes in one step
    (the prefill wrapper serves them all); and the 200 decodes leading (they go to the decode
    wrapper, the other rows to the prefill one)."""
    decodes = random_decode_rows(200, 8192, 3)
    rows = {"prompts": PROMPT_ROWS, "mixed": MIXED_ROWS + decodes}.get(kind, decodes + MIXED_ROWS)
    batch, window = batch_for(config, rows, seed=len(rows))
    out, meta, builder = run_eager(batch, window)
    assert not meta.decode_only
    assert len(meta.parts) == (2 if kind == "decodes-first" else 1)
    assert builder.prefill_backend == (
        "fa3" if torch.cuda.get_device_capability()[0] == 9 else "fa2"
    )
    assert_new_kv_written(batch)
    assert_matches_reference(out, batch, make_impl(batch, window).scale, window)


@pytest.mark.parametrize("kind", ["prompts", "decodes-first"])
def test_later_layers_replay_the_recorded_prefill_call_bit_for_bit(kind, monkeypatch):
    """With the real FlashInfer, the prefill wrapper's run makes one paged_run call with the
    query, the pages and the output as arguments (so `replay` records it), and four layers of a
    step (each with its own query, K/V and cache), the later three replayed, give bit for bit
    what each layer's own run gives."""
    from dataclasses import replace

    from pagellm_flashinfer import replay
    from pagellm_flashinfer.builder import FlashInferMetadataBuilder

    decodes = random_decode_rows(64, 4096, 5)
    rows = PROMPT_ROWS if kind == "prompts" else decodes + MIXED_ROWS
    base, window = batch_for(CONFIGS[0], rows, seed=11)
    layers = [
        replace(
            base,
            query=base.query * f,
            key=base.key * f,
            value=base.value * f,
            kv_cache=base.kv_cache * f,
        )
        for f in (1.0, -0.5, 2.0, 0.25)
    ]
    impl = make_impl(base, window)

    def step(replays: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(replay._State, "enabled", replays)
        monkeypatch.setattr(replay._State, "checked", False)
        builder = FlashInferMetadataBuilder(spec_of(base, window), torch.device("cuda"))
        meta = builder.build(base.common)
        outs = []
        for layer in layers:
            cache = layer.kv_cache.clone()
            outs.append(impl.forward(*layer.flat(), cache, meta).clone())
        prefill = meta.parts[-1]
        assert prefill.call is not None and (prefill.call._slots is not None) == replays
        assert replay._State.enabled == replays  # the first replay's check passed
        return outs

    replayed, run = step(True), step(False)
    for a, b in zip(replayed, run, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_decode_of_256_rows_matches_reference(config):
    batch, window = batch_for(config, random_decode_rows(256, 8192, seed=7))
    out, meta, _ = run_eager(batch, window)
    assert meta.decode_only
    assert_new_kv_written(batch)
    assert_matches_reference(out, batch, make_impl(batch, window).scale, window)


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[4]], ids=str)
@pytest.mark.parametrize("kind", ["decodes", "decodes-first"])
def test_triton_decode_rows_match_reference(config, kind, monkeypatch):
    """``PAGELLM_FLASHINFER_DECODE=triton``: 256 decode rows, and 200 leading a mixed step (the
    prefill wrapper serves the others, then TRITON_ATTN's kernel every one-token row)."""
    monkeypatch.setenv(DECODE_VAR, "triton")
    decodes = random_decode_rows(256 if kind == "decodes" else 200, 8192, seed=11)
    batch, window = batch_for(config, decodes if kind == "decodes" else decodes + MIXED_ROWS)
    out, meta, _ = run_eager(batch, window)
    assert meta.decode_only == (kind == "decodes")
    assert_new_kv_written(batch)
    assert_matches_reference(out, batch, make_impl(batch, window).scale, window)


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[4]], ids=str)
def test_few_long_decode_rows_match_reference(config):
    """Few rows of long contexts: FlashInfer splits their keys among several programs."""
    batch, window = batch_for(config, [(16000, 1), (8191, 1), (3, 1), (12345, 1)])
    out, _, _ = run_eager(batch, window)
    assert_matches_reference(out, batch, make_impl(batch, window).scale, window)


@pytest.mark.parametrize("block_size", [32, 64])
def test_other_block_sizes_match_reference(block_size):
    rows = MIXED_ROWS + random_decode_rows(50, 4000, seed=block_size)
    batch, window = batch_for(CONFIGS[0], rows, block_size=block_size)
    out, _, builder = run_eager(batch, window)
    assert_matches_reference(out, batch, make_impl(batch, window).scale, window)
    decodes, _ = batch_for(CONFIGS[0], random_decode_rows(64, 4000, 1), block_size=block_size)
    out, _, _ = run_eager(decodes, window, builder)
    assert_matches_reference(out, decodes, make_impl(decodes, window).scale, window)


def test_one_builder_serves_steps_of_every_kind_in_turn():
    """Eager steps one after another on one builder: its pinned arrays are reused safely."""
    builder = None
    for seed, rows in enumerate(
        [MIXED_ROWS, random_decode_rows(100, 3000, 1), [(500, 20)], random_decode_rows(3, 900, 2)]
    ):
        batch, window = batch_for(CONFIGS[1], rows, seed=seed)
        out, _, builder = run_eager(batch, window, builder)
        assert_matches_reference(out, batch, make_impl(batch, window).scale, window)


@pytest.mark.parametrize("replans", [True, False], ids=["replanned", "planned-once"])
@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[4]], ids=str)
def test_decode_replayed_from_a_cuda_graph_matches_eager_and_reference(
    config, replans, monkeypatch
):
    """The builder's capture-time metadata over persistent buffers, captured once, replayed for
    three batches written into those buffers in place, each prepared by
    `prepare_cudagraph_replay` (rescheduled with split-KV, or, planned once without split-KV,
    only its buffers rewritten); the replay gives what the same plan gives run eagerly, bit for
    bit."""
    from pagellm_flashinfer.builder import FlashInferMetadataBuilder

    monkeypatch.setattr(
        FlashInferMetadataBuilder, "graph_split_kv_below_ctas", 1 << 20 if replans else 0
    )
    dtype, head_size, num_heads, num_kv_heads, window = config
    max_model_len, block_size, num_rows = 16384, 16, 8
    batches = [
        batch_for(config, random_decode_rows(6, 12000, seed=s), seed=s, padding_rows=2)[0]
        for s in (1, 2, 3)
    ]
    batches[2] = batch_for(config, [(15000, 1), (40, 1)], seed=9, padding_rows=6)[0]
    dev = torch.device("cuda")
    torch_dtype = DTYPES[dtype]
    qsl = torch.arange(num_rows + 1, dtype=torch.int32, device=dev)
    seq_lens = torch.zeros(num_rows, dtype=torch.int32, device=dev)
    block_table = torch.zeros(num_rows, max_model_len // block_size, dtype=torch.int32, device=dev)
    slot_mapping = torch.full((num_rows,), -1, dtype=torch.int64, device=dev)
    query = torch.zeros(num_rows, num_heads * head_size, dtype=torch_dtype, device=dev)
    key = torch.zeros(num_rows, num_kv_heads * head_size, dtype=torch_dtype, device=dev)
    value = torch.zeros_like(key)
    num_blocks = max(b.kv_cache.shape[1] for b in batches)
    kv_cache = torch.zeros(
        2, num_blocks, block_size, num_kv_heads, head_size, dtype=torch_dtype, device=dev
    )

    def common(max_seq_len: int, cols: int, host_seq_lens: torch.Tensor):
        return CommonAttentionMetadata(
            num_reqs=num_rows,
            num_actual_tokens=num_rows,
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc=qsl,
            query_start_loc_cpu=qsl.cpu().pin_memory(),
            seq_lens=seq_lens,
            seq_lens_cpu=host_seq_lens.pin_memory(),
            block_table=block_table[:, :cols],
            slot_mapping=slot_mapping,
        )

    spec = KVCacheSpec(block_size, num_kv_heads, head_size, torch_dtype, window)
    builder = FlashInferMetadataBuilder(spec, dev)
    meta = builder.build_for_cudagraph(
        common(max_model_len, block_table.shape[1], torch.zeros(num_rows, dtype=torch.int32))
    )
    impl = make_impl(batches[0], window)
    for _ in range(2):  # warm-up: planned (and kernels loaded) outside the capture
        impl.forward(query, key, value, kv_cache, meta)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = impl.forward(query, key, value, kv_cache, meta)
    for batch in batches:
        c = batch.common
        seq_lens.copy_(c.seq_lens)
        block_table.zero_()
        block_table[:, : c.block_table.shape[1]] = c.block_table
        slot_mapping.copy_(c.slot_mapping)
        query.copy_(batch.query.reshape(num_rows, -1))
        key.copy_(batch.key.reshape(num_rows, -1))
        value.copy_(batch.value.reshape(num_rows, -1))
        kv_cache.fill_(float("nan"))
        kv_cache[:, : batch.kv_cache.shape[1]] = batch.kv_cache
        builder.prepare_cudagraph_replay(
            meta, common(c.max_seq_len, c.block_table.shape[1], c.seq_lens_cpu.clone())
        )
        graph.replay()
        replayed = out.view(batch.query.shape).clone()
        batch.kv_cache = kv_cache
        assert_new_kv_written(batch)
        assert_matches_reference(replayed, batch, impl.scale, window)
        eager = impl.forward(query, key, value, kv_cache, meta).view(batch.query.shape)
        num_real = num_rows - batch.num_padding
        assert torch.equal(replayed[:num_real], eager[:num_real]), "replay differs from eager"


# ---------------------------------------------------------------------------- timings


def test_print_decode_and_prefill_timings(capsys: pytest.CaptureFixture[str]) -> None:
    """Decode of 256 rows x 1k context and prefill of 8,192 tokens, head 128, bf16, block 16, in
    the format of TRITON_ATTN's timings (docs/benchmarks.md): the attention kernels alone, on
    a plan made once."""
    from triton.testing import do_bench

    lines = [
        f"{torch.cuda.get_device_name()}, bf16, head 128, block 16, do_bench medians; "
        "decode GB/s = K+V bytes read / time"
    ]

    def timed(meta, batch: Batch) -> float:
        out = torch.empty_like(batch.query)
        caches = (batch.kv_cache[0], batch.kv_cache[1])

        def run() -> None:
            for part in meta.parts:
                rows = slice(part.start, part.end)
                part.wrapper.run(batch.query[rows], caches, out=out[rows])

        return do_bench(run, return_mode="median")

    for heads, kv_heads in ((16, 8), (32, 8)):
        config = ("bf16", 128, heads, kv_heads, None)
        batch, _ = batch_for(config, [(1023, 1)] * 256)
        _, meta, builder = run_eager(batch, None)
        ms = timed(meta, batch)
        label = f"decode 256 rows x 1k ctx, {heads}q/{kv_heads}kv heads"
        lines.append(
            f"{label:<44} {'decode':<10} {ms * 1e3:8.1f} us  {batch.kv_bytes() / ms / 1e6:6.0f} GB/s"
        )
        # Nearly the same rows as decode rows of a mixed step: the 255 decodes on the decode
        # wrapper, the 2-token row on the prefill one; then the 2-token row first, so that all
        # rows go through the prefill wrapper.
        for label, rows in (
            ("  255 of them and a 2-token row (mixed step)", [(1023, 1)] * 255 + [(1022, 2)]),
            ("  the same, the 2-token row first", [(1022, 2)] + [(1023, 1)] * 255),
        ):
            mixed, _ = batch_for(config, rows)
            _, meta, _ = run_eager(mixed, None, builder)
            assert not meta.decode_only
            ms = timed(meta, mixed)
            how = "+".join(
                "decode" if p.index.max_query_len == 1 else "prefill" for p in meta.parts
            )
            lines.append(
                f"{label:<44} {how:<14} {ms * 1e3:8.1f} us  {mixed.kv_bytes() / ms / 1e6:6.0f} GB/s"
            )
        long_rows, _ = batch_for(config, [(32767, 1)] * 4)
        _, meta, _ = run_eager(long_rows, None, builder)
        ms = timed(meta, long_rows)
        label = f"decode 4 rows x 32k ctx, {heads}q/{kv_heads}kv heads"
        lines.append(
            f"{label:<44} {'decode':<10} {ms * 1e3:8.1f} us  {long_rows.kv_bytes() / ms / 1e6:6.0f} GB/s"
        )
        prompt, _ = batch_for(config, [(0, 8192)])
        _, meta, _ = run_eager(prompt, None, builder)
        ms = timed(meta, prompt)
        flops = 4 * heads * 128 * 8192 * 8192 / 2  # QK^T and PV over the causal half
        lines.append(
            f"{f'prefill 8192 tokens, {heads}q/{kv_heads}kv heads':<44} "
            f"{builder.prefill_backend:<10} {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s"
        )
        del batch, mixed, long_rows, prompt, builder
        gc.collect()
        torch.cuda.empty_cache()
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def test_print_decode_timings_by_block_size_and_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    """Decode of 256 rows x 1k context (head 128, bf16) at block sizes 16, 32 and 64, on the
    tensor-core decode kernels (what the backend runs) and on the CUDA-core ones, with split-KV
    left to FlashInfer's scheduler and disabled: which page size and kernel read K/V fastest."""
    import flashinfer
    from pagellm_flashinfer.planning import KV_LAYOUT, LayerParams
    from triton.testing import do_bench

    lines = ["decode 256 rows x 1k ctx, head 128, bf16, do_bench medians (K+V bytes / time)"]
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    # The full sweep (blocks 16/32/64, 32q/8kv too) is in docs/benchmarks.md (2026-12-01): the
    # tensor-core kernels won everywhere, split-KV made no difference at this size.
    for heads, kv_heads in ((16, 8),):
        config = ("bf16", 128, heads, kv_heads, None)
        for block_size in (16, 64):
            batch, _ = batch_for(config, [(1023, 1)] * 256, block_size=block_size)
            _, meta, builder = run_eager(batch, None)
            index, spec = meta.index, builder.kv_cache_spec
            params = LayerParams(heads, 128**-0.5, -1)
            caches = (batch.kv_cache[0], batch.kv_cache[1])
            out = torch.empty_like(batch.query)
            for tensor_cores in (True, False):
                for no_split in (False, True):
                    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                        workspace, KV_LAYOUT, use_tensor_cores=tensor_cores
                    )
                    wrapper.plan(
                        index.kv_indptr,
                        index.kv_indices,
                        index.kv_last_page_len,
                        heads,
                        kv_heads,
                        128,
                        block_size,
                        pos_encoding_mode="NONE",
                        q_data_type=spec.dtype,
                        kv_data_type=spec.dtype,
                        sm_scale=params.sm_scale,
                        disable_split_kv=no_split,
                    )
                    ms = do_bench(
                        functools.partial(wrapper.run, batch.query, caches, out=out),
                        return_mode="median",
                    )
                    kind = "tensor cores" if tensor_cores else "CUDA cores"
                    lines.append(
                        f"{heads}q/{kv_heads}kv block {block_size:<3} {kind:<13} "
                        f"{'no split' if no_split else 'auto split':<11} {ms * 1e3:8.1f} us  "
                        f"{batch.kv_bytes() / ms / 1e6:6.0f} GB/s"
                    )
            del batch, meta, builder, caches, out
            gc.collect()
            torch.cuda.empty_cache()
    with capsys.disabled():
        print("\n" + "\n".join(lines))


# ---------------------------------------------------------------------------- end to end

COMMON = dict(
    vocab_size=2048,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
MODELS = {
    "llama": dict(model_type="llama", head_dim=64),  # head 64, GQA 4:1
    "qwen3": dict(model_type="qwen3", head_dim=128, tie_word_embeddings=True),  # head 128
}
NUM_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("flashinfer_models")
    paths = {}
    for kind, extra in MODELS.items():
        spec = {**COMMON, **extra}
        config = AutoConfig.for_model(spec.pop("model_type"), **spec)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" not in name:
                    param.normal_(0.0, 0.05)  # peaked logits: fewer near-ties between kernels
        model.save_pretrained(root / kind)
        paths[kind] = str(root / kind)
        del model
    torch.cuda.empty_cache()
    return paths


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    result = [rng.integers(3, 2048, n).tolist() for n in (7, 33, 150, 300, 517, 64, 1000, 260)]
    result.append(result[3][:200] + rng.integers(3, 2048, 40).tolist())  # shares a prefix
    return result


def llm(model: str, backend: str, **kwargs):
    from pagellm import LLM

    return LLM(
        model,
        dtype="bfloat16",
        attention_backend=backend,
        skip_tokenizer_init=True,
        max_model_len=2048,
        max_num_batched_tokens=512,  # chunked prefill with cached context, next to decodes
        kv_cache_memory=1 << 30,
        **kwargs,
    )


def release_gpu_memory() -> None:
    """After the last reference to an engine is gone."""
    gc.collect()
    torch.cuda.empty_cache()


def generate(model: str, backend: str, **kwargs) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Per prompt: the greedy tokens, and per position the logprobs of the two most likely
    tokens, the pick among them (a `pagellm.testing.greedy.GreedyRun`)."""
    from pagellm import SamplingParams

    engine = llm(model, backend, **kwargs)
    assert engine.llm_engine.config.attention_backend == backend
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, logprobs=2, ignore_eos=True)
    outputs = engine.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    result = [greedy_run(o.outputs[0]) for o in outputs]
    del engine, outputs
    release_gpu_memory()
    return result


def teacher_forced(model: str, backend: str, generations) -> list[list[tuple[int, float]]]:
    """``backend``'s (rank, logprob) of each generated token given the prompt and the tokens
    before it, from one prefill of prompt + generation (prompt logprobs)."""
    from pagellm import SamplingParams

    engine = llm(model, backend)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    requests = [{"prompt_token_ids": p + g[0]} for p, g in zip(prompts(), generations, strict=True)]
    outputs = engine.generate(requests, params, use_tqdm=False)
    scores = []
    for prompt, (tokens, _), o in zip(prompts(), generations, outputs, strict=True):
        positions = o.prompt_logprobs[len(prompt) : len(prompt) + len(tokens)]
        scores.append(
            [(pos[t].rank, pos[t].logprob) for pos, t in zip(positions, tokens, strict=True)]
        )
    del engine, outputs
    release_gpu_memory()
    return scores


@pytest.mark.parametrize("decode", DECODE_KERNELS)
@pytest.mark.parametrize("kind", list(MODELS))
def test_greedy_tokens_are_triton_attn_argmaxes(models, kind, decode, monkeypatch):
    """FLASHINFER's greedy tokens, scored by TRITON_ATTN over the same sequences (teacher
    forcing, so that one near-tie cannot send the rest down another path): its argmax at nearly
    every position, with close logprobs (the bfloat16 tolerances of the suite against HF); its
    one-token rows on FlashInfer's decode wrapper or on TRITON_ATTN's kernel."""
    monkeypatch.setenv(DECODE_VAR, decode)
    generations = generate(models[kind], "FLASHINFER")
    scores = teacher_forced(models[kind], "TRITON_ATTN", generations)
    agree = total = 0
    worst = 0.0
    for run, row in zip(generations, scores, strict=True):
        tokens, lps = run[0], chosen_logprobs(run)
        assert len(tokens) == NUM_NEW_TOKENS
        agree += sum(rank == 1 for rank, _ in row)
        total += len(row)
        worst = max(worst, *(abs(a - b) for a, (_, b) in zip(lps, row, strict=True)))
    print(
        f"{kind} bf16 FLASHINFER ({decode} decode) vs TRITON_ATTN: top-1 {agree}/{total}, "
        f"max |dlogprob| {worst:.4f}"
    )
    assert agree / total >= 0.93, f"top-1 agreement {agree}/{total}"
    assert worst <= 0.15, f"max logprob difference {worst}"


@pytest.mark.parametrize("decode", DECODE_KERNELS)
def test_cuda_graphs_give_the_tokens_of_eager_steps(models, decode, monkeypatch):
    """Graphs and eager steps may part only at a near-tie (`pagellm.testing.greedy`): up to the
    first differing token the logprobs agree within 0.1; at it each run's pick is the other's
    runner-up within 0.1."""
    monkeypatch.setenv(DECODE_VAR, decode)
    graphs = generate(models["qwen3"], "FLASHINFER")
    eager = generate(models["qwen3"], "FLASHINFER", enforce_eager=True)
    identical = count_identical_with_near_ties(graphs, eager, 0.1, decode)
    print(
        f"qwen3 ({decode} decode): {identical}/{len(graphs)} sequences identical, graphs vs eager"
    )
    assert identical >= 1


def test_a_builder_finds_its_kernel_modules_in_the_jit_cache(caplog):
    """This module's fixture compiled them: a new builder (an engine start) compiles nothing."""
    from pagellm_flashinfer.builder import FlashInferMetadataBuilder

    with caplog.at_level(logging.INFO, logger="pagellm_flashinfer.jit_cache"):
        FlashInferMetadataBuilder(KVCacheSpec(16, 2, 128, torch.bfloat16), torch.device("cuda"))
    assert "kernel modules found in the JIT cache" in caplog.text
    assert "compiling" not in caplog.text
