"""TRITON_ATTN's kernels on a CUDA GPU at serving sizes (head sizes 64/128/256, contexts up to 8k,
256 decode rows, GQA 2:1 and 4:1, bf16/fp16/fp32) against a float32 torch reference; decode
replayed from a CUDA graph; and timings (printed, not asserted: speed belongs to benchmarks).

Run on the device machine with ``pytest -m gpu plugins/attention_backends/triton/tests``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

from pagellm.attention.backend import CommonAttentionMetadata
from pagellm.kv_cache.spec import KVCacheSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 would not compile"
    ),
]

PLUGIN_DIR = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Against float32: the kernels round probabilities to the input dtype before P @ V.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 3e-3}
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def pkg() -> Iterator[tuple[ModuleType, ModuleType]]:
    """(kernels, backend), importable whether or not pagellm-triton-attn is pip-installed."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(PLUGIN_DIR))
        from pagellm_triton_attn import backend, kernels

        yield kernels, backend


@pytest.fixture(autouse=True)
def exact_float32_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    # The reference must not run its float32 matmuls in TF32.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


# ---------------------------------------------------------------------------- batches


@dataclass
class Batch:
    """A step on the GPU: the context before the step is in the cache, the new tokens' K/V in
    ``key``/``value``; every other cache slot holds NaN."""

    query: torch.Tensor  # [T, H, D], a column slice of a fused QKV projection
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, Hkv, BLOCK_SIZE, D]
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    keys: torch.Tensor  # every row's whole sequence, concatenated: [sum(seq_lens), Hkv, D]
    values: torch.Tensor
    rows: list[tuple[int, int]]  # (context, new tokens); padding rows are (0, 1) with seq_len 0
    num_padding: int

    @property
    def num_tokens(self) -> int:
        return self.query.shape[0]

    @property
    def num_reqs(self) -> int:
        return len(self.rows)

    @property
    def max_query_len(self) -> int:
        return max(new for _, new in self.rows)

    def kv_bytes(self) -> int:
        """Bytes of K and V one attention pass over the batch reads (each once)."""
        return 2 * self.keys.numel() * self.keys.element_size()


def make_batch(
    rows: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
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
    blocks = (seq_lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    total_blocks = int(blocks.sum())
    num_blocks = total_blocks + 9  # the null block 0 and a few never used
    shuffled = torch.randperm(num_blocks - 1, device=dev, generator=gen) + 1
    block_table = torch.zeros(num_rows, max(int(blocks.max()), 1), dtype=torch.int32, device=dev)
    row_of_block = torch.repeat_interleave(torch.arange(num_rows, device=dev), blocks)
    col = torch.arange(total_blocks, device=dev) - torch.repeat_interleave(
        torch.cumsum(blocks, 0) - blocks, blocks
    )
    block_table[row_of_block, col] = shuffled[:total_blocks].int()

    total = int(seq_lens.sum())
    keys = torch.randn(total, num_kv_heads, head_size, device=dev, generator=gen).to(dtype)
    values = torch.randn(total, num_kv_heads, head_size, device=dev, generator=gen).to(dtype)
    row_of_pos = torch.repeat_interleave(torch.arange(num_rows, device=dev), seq_lens)
    pos = torch.arange(total, device=dev) - torch.repeat_interleave(
        torch.cumsum(seq_lens, 0) - seq_lens, seq_lens
    )
    slots = block_table[row_of_pos, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
    cached = pos < contexts[row_of_pos]
    kv_cache = torch.full(
        (2, num_blocks, num_kv_heads, BLOCK_SIZE, head_size), float("nan"), dtype=dtype, device=dev
    )
    ctx_slots = slots[cached]
    kv_cache[0][ctx_slots // BLOCK_SIZE, :, ctx_slots % BLOCK_SIZE] = keys[cached]
    kv_cache[1][ctx_slots // BLOCK_SIZE, :, ctx_slots % BLOCK_SIZE] = values[cached]

    def pad(x: torch.Tensor) -> torch.Tensor:
        extra = torch.randn(padding_rows, *x.shape[1:], device=dev, generator=gen).to(dtype)
        return torch.cat([x, extra])

    slot_mapping = torch.cat([slots[~cached], torch.full((padding_rows,), -1, device=dev)])
    num_tokens = int(new.sum())
    fused = torch.randn(
        num_tokens, (num_heads + 2 * num_kv_heads) * head_size, device=dev, generator=gen
    ).to(dtype)
    query = fused[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)
    qsl = torch.zeros(num_rows + 1, dtype=torch.int32, device=dev)
    qsl[1:] = torch.cumsum(new, 0)
    return Batch(
        query=query,
        key=pad(keys[~cached]),
        value=pad(values[~cached]),
        kv_cache=kv_cache,
        query_start_loc=qsl,
        seq_lens=seq_lens.int(),
        block_table=block_table,
        slot_mapping=slot_mapping,
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
    num_real = batch.num_reqs - batch.num_padding
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
    assert torch.isfinite(out).all(), "some outputs were never written (still NaN)"
    tol = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(out.float(), reference(batch, scale, window), atol=tol, rtol=tol)


def write_cache(kernels: ModuleType, batch: Batch) -> None:
    kernels.write_kv_cache(
        batch.key, batch.value, *kernels.split_kv_cache(batch.kv_cache), batch.slot_mapping
    )


def run_mixed(
    kernels: ModuleType,
    batch: Batch,
    scale: float,
    window: int | None,
    out: torch.Tensor,
    skip_decodes: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    kernels.paged_attention(
        batch.query,
        *kernels.split_kv_cache(batch.kv_cache),
        out,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_table,
        num_reqs=batch.num_reqs,
        num_tokens=batch.num_tokens,
        max_query_len=batch.max_query_len,
        scale=scale,
        sliding_window=window,
        skip_decodes=skip_decodes,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def run_decode(
    kernels: ModuleType,
    batch: Batch,
    scale: float,
    window: int | None,
    out: torch.Tensor,
    num_splits: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    tiles: object = None,
) -> None:
    """``tiles``: a `launch.Tiles` other than the default (None)."""
    num_heads, head_size = batch.query.shape[1:]
    scratch = None
    if num_splits > 1:
        scratch = kernels.split_scratch(
            batch.num_reqs, num_heads, head_size, num_splits, torch.device("cuda")
        )
        for buffer in scratch:
            buffer.fill_(float("nan"))
    kernels.paged_decode(
        batch.query,
        *kernels.split_kv_cache(batch.kv_cache),
        out,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_table,
        num_rows=batch.num_reqs,
        scale=scale,
        sliding_window=window,
        num_splits=num_splits,
        scratch=scratch,
        k_scale=k_scale,
        v_scale=v_scale,
        tiles=tiles,
    )


def swapped_tiles(head_size: int, fp8_mma: bool = False) -> object:
    """`Tiles.swap_ab` (both decode products transposed: warpgroup MMAs on sm_90)."""
    from pagellm_triton_attn.kernels.launch import Tiles

    block_n = 64 if head_size <= 128 else 32
    return Tiles(block_n=block_n, num_warps=4, num_stages=2, swap_ab=True, fp8_mma=fp8_mma)


def poisoned(batch: Batch) -> torch.Tensor:
    return torch.full_like(batch.query, float("nan"))


def random_decode_rows(n: int, max_context: int, seed: int) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(seed)
    return [(int(c), 1) for c in torch.randint(0, max_context, (n,), generator=gen)]


def auto_splits(
    kernels: ModuleType, backend: ModuleType, rows: int, kv_heads: int, max_len: int
) -> int:
    """The builder's split count on this GPU."""
    builder = backend.TritonAttentionMetadataBuilder
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return kernels.num_decode_splits(
        rows, kv_heads, max_len, builder.programs_per_sm * sms, builder.min_keys_per_split
    )


# (dtype, head size, query heads, KV heads, sliding window): Qwen3-0.6B, Llama-3.1-8B, and more.
CONFIGS = [
    ("bf16", 128, 16, 8, None),
    ("bf16", 128, 32, 8, None),
    ("fp16", 128, 32, 8, 2048),
    ("bf16", 64, 16, 8, None),
    ("fp16", 64, 32, 8, 1000),
    ("bf16", 256, 8, 4, 4096),
    ("fp32", 128, 16, 8, None),
    ("fp32", 256, 16, 4, 1500),
]


# ---------------------------------------------------------------------------- kernels


def test_kv_write_stores_new_tokens_and_skips_padding(pkg):
    kernels, _ = pkg
    batch = make_batch(
        [(1000, 300), (0, 2000), (77, 1)],
        num_heads=32,
        num_kv_heads=8,
        head_size=128,
        dtype=torch.bfloat16,
        padding_rows=5,
    )
    nan_before = int(batch.kv_cache.isnan().sum())
    write_cache(kernels, batch)
    live = batch.slot_mapping >= 0
    slots = batch.slot_mapping[live]
    for i in range(2):
        stored = batch.kv_cache[i][slots // BLOCK_SIZE, :, slots % BLOCK_SIZE]
        assert torch.equal(stored, (batch.key, batch.value)[i][live])
    written = 2 * int(live.sum()) * 8 * 128
    assert int(batch.kv_cache.isnan().sum()) == nan_before - written


@pytest.mark.parametrize("dtype, head_size, num_heads, num_kv_heads, window", CONFIGS)
def test_mixed_batch_matches_reference(pkg, dtype, head_size, num_heads, num_kv_heads, window):
    """Prompts, chunks after long cached contexts and 200 decodes: in one launch, and split
    between the mixed and the decode kernels."""
    kernels, _ = pkg
    rows = [(0, 2048), (3000, 512), (6900, 1200), (0, 37), (129, 64), (8000, 1)]
    rows += random_decode_rows(200, 8192, seed=head_size)
    batch = make_batch(
        rows,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=DTYPES[dtype],
        seed=num_heads,
    )
    scale = head_size**-0.5
    write_cache(kernels, batch)
    out = poisoned(batch)
    run_mixed(kernels, batch, scale, window, out)
    assert_matches_reference(out, batch, scale, window)

    out = poisoned(batch)
    run_mixed(kernels, batch, scale, window, out, skip_decodes=True)
    run_decode(kernels, batch, scale, window, out, num_splits=2)
    assert_matches_reference(out, batch, scale, window)


@pytest.mark.parametrize("dtype, head_size, num_heads, num_kv_heads, window", CONFIGS)
@pytest.mark.parametrize("num_splits", [1, 5, "auto"])
@pytest.mark.parametrize("swap_ab", [False, True])
def test_decode_of_256_rows_matches_reference(
    pkg, dtype, head_size, num_heads, num_kv_heads, window, num_splits, swap_ab
):
    """The default kernel, and with `Tiles.swap_ab` both products transposed."""
    kernels, backend = pkg
    rows = random_decode_rows(256, 8192, seed=7)
    batch = make_batch(
        rows,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=DTYPES[dtype],
        padding_rows=8,
    )
    if num_splits == "auto":
        num_splits = auto_splits(kernels, backend, 256, num_kv_heads, 8192)
    scale = head_size**-0.5
    write_cache(kernels, batch)
    out = poisoned(batch)
    tiles = swapped_tiles(head_size) if swap_ab else None
    run_decode(kernels, batch, scale, window, out, num_splits, tiles=tiles)
    assert_matches_reference(out, batch, scale, window)
    assert torch.equal(out[-8:], torch.zeros_like(out[-8:])), "padding rows must give zeros"


@pytest.mark.parametrize("dtype, head_size, num_heads, num_kv_heads, window", CONFIGS[:3])
def test_split_kv_decode_of_few_long_rows_matches_reference(
    pkg, dtype, head_size, num_heads, num_kv_heads, window
):
    kernels, backend = pkg
    batch = make_batch(
        [(16000, 1), (8191, 1), (3, 1), (12345, 1)],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=DTYPES[dtype],
    )
    num_splits = auto_splits(kernels, backend, 4, num_kv_heads, 16001)
    assert num_splits > 1
    scale = head_size**-0.5
    write_cache(kernels, batch)
    out = poisoned(batch)
    run_decode(kernels, batch, scale, window, out, num_splits)
    assert_matches_reference(out, batch, scale, window)


def test_decode_replayed_from_a_cuda_graph_matches_reference(pkg):
    """The backend's capture-time metadata over persistent buffers, captured once, replayed for
    two batches written into those buffers in place (split-KV on: 8 rows)."""
    _, backend = pkg
    num_heads, num_kv_heads, head_size, max_model_len = 32, 8, 128, 16384
    kwargs = dict(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=torch.bfloat16,
        padding_rows=2,
    )
    batches = [make_batch(random_decode_rows(6, 12000, seed=s), seed=s, **kwargs) for s in (1, 2)]
    num_rows = batches[0].num_reqs
    spec = KVCacheSpec(BLOCK_SIZE, num_kv_heads, head_size, torch.bfloat16)
    builder = backend.TritonAttentionMetadataBuilder(spec, torch.device("cuda"))
    impl = backend.TritonAttentionImpl(num_heads, head_size, head_size**-0.5, num_kv_heads, None)
    dev = torch.device("cuda")
    qsl = torch.arange(num_rows + 1, dtype=torch.int32, device=dev)
    seq_lens = torch.zeros(num_rows, dtype=torch.int32, device=dev)
    block_table = torch.zeros(num_rows, max_model_len // BLOCK_SIZE, dtype=torch.int32, device=dev)
    slot_mapping = torch.full((num_rows,), -1, dtype=torch.int64, device=dev)
    query = torch.zeros(num_rows, num_heads * head_size, dtype=torch.bfloat16, device=dev)
    key = torch.zeros(num_rows, num_kv_heads * head_size, dtype=torch.bfloat16, device=dev)
    value = torch.zeros_like(key)
    num_blocks = max(b.kv_cache.shape[1] for b in batches)
    kv_cache = torch.zeros(
        2, num_blocks, num_kv_heads, BLOCK_SIZE, head_size, dtype=torch.bfloat16, device=dev
    )
    common = CommonAttentionMetadata(
        num_reqs=num_rows,
        num_actual_tokens=num_rows,
        max_query_len=1,
        max_seq_len=max_model_len,
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.cpu(),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.cpu(),
        block_table=block_table,
        slot_mapping=slot_mapping,
    )
    meta = builder.build_for_cudagraph(common)
    assert meta.num_splits > 1
    for _ in range(2):  # warm-up: compile outside the capture
        impl.forward(query, key, value, kv_cache, meta)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = impl.forward(query, key, value, kv_cache, meta)
    for batch in batches:
        seq_lens.copy_(batch.seq_lens)
        block_table.zero_()
        block_table[:, : batch.block_table.shape[1]] = batch.block_table
        slot_mapping.copy_(batch.slot_mapping)
        query.copy_(batch.query.reshape(num_rows, -1))
        key.copy_(batch.key.reshape(num_rows, -1))
        value.copy_(batch.value.reshape(num_rows, -1))
        kv_cache.fill_(float("nan"))
        kv_cache[:, : batch.kv_cache.shape[1]] = batch.kv_cache
        graph.replay()
        result = out.view(batch.query.shape)
        assert_matches_reference(result, batch, impl.scale, None)
        assert torch.equal(result[-2:], torch.zeros_like(result[-2:]))


# ---------------------------------------------------------------------------- timings


def test_print_decode_and_prefill_timings(pkg, capsys: pytest.CaptureFixture[str]) -> None:
    from triton.testing import do_bench

    kernels, backend = pkg
    lines = [
        f"{torch.cuda.get_device_name()}, bf16, head 128, block 16, do_bench medians; "
        "decode GB/s = K+V bytes read / time"
    ]

    def decode_line(label: str, batch: Batch, splits: int, heads: int, kv_heads: int) -> str:
        out = torch.empty_like(batch.query)
        scratch = None
        if splits > 1:
            scratch = kernels.split_scratch(batch.num_reqs, heads, 128, splits, out.device)

        def decode() -> None:
            kernels.paged_decode(
                batch.query,
                *kernels.split_kv_cache(batch.kv_cache),
                out,
                batch.query_start_loc,
                batch.seq_lens,
                batch.block_table,
                num_rows=batch.num_reqs,
                scale=0.088,
                sliding_window=None,
                num_splits=splits,
                scratch=scratch,
            )

        ms = do_bench(decode, return_mode="median")
        gbs = batch.kv_bytes() / ms / 1e6
        return f"{label:<44} splits={splits:<3} {ms * 1e3:8.1f} us  {gbs:6.0f} GB/s"

    for heads, kv_heads in ((16, 8), (32, 8)):
        kwargs = dict(num_heads=heads, num_kv_heads=kv_heads, head_size=128, dtype=torch.bfloat16)
        batch = make_batch([(1023, 1)] * 256, **kwargs)
        write_cache(kernels, batch)
        label = f"decode 256 rows x 1k ctx, {heads}q/{kv_heads}kv heads"
        lines.append(decode_line(label, batch, 1, heads, kv_heads))
        out = torch.empty_like(batch.query)
        ms = do_bench(
            lambda b=batch, o=out: run_mixed(kernels, b, 0.088, None, o), return_mode="median"
        )
        lines.append(
            f"{'  same batch through the mixed kernel':<44} {'':<10} {ms * 1e3:8.1f} us  "
            f"{batch.kv_bytes() / ms / 1e6:6.0f} GB/s"
        )
        long_rows = make_batch([(32767, 1)] * 4, **kwargs)
        write_cache(kernels, long_rows)
        label = f"decode 4 rows x 32k ctx, {heads}q/{kv_heads}kv heads"
        splits = auto_splits(kernels, backend, 4, kv_heads, 32768)
        lines.append(decode_line(label, long_rows, 1, heads, kv_heads))
        lines.append(decode_line(label, long_rows, splits, heads, kv_heads))

        prompt = make_batch([(0, 8192)], **kwargs)
        write_cache(kernels, prompt)
        out = torch.empty_like(prompt.query)
        ms = do_bench(
            lambda b=prompt, o=out: run_mixed(kernels, b, 0.088, None, o), return_mode="median"
        )
        flops = 4 * heads * 128 * 8192 * 8192 / 2  # QK^T and PV over the causal half
        lines.append(
            f"{f'prefill 8192 tokens, {heads}q/{kv_heads}kv heads':<44} {'':<10} "
            f"{ms * 1e3:8.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s"
        )
        del batch, long_rows, prompt
    with capsys.disabled():
        print("\n" + "\n".join(lines))
