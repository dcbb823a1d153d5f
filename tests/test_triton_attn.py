"""TRITON_ATTN on CPU, through Triton's interpreter.

The kernels run on random paged caches (shuffled block tables, unwritten slots poisoned with NaN,
outputs poisoned with NaN) against a float64 reference; the backend runs end to end in the engine
and must give TORCH_SDPA's greedy tokens. GPU sizes and timing live in tests/gpu.
"""

from __future__ import annotations

import importlib
import math
import random
import sys
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.attention.backend import CommonAttentionMetadata
from pagellm.kv_cache.spec import KVCacheSpec

# Empty splits and padding rows take log2(0) = -inf on purpose; NumPy (the interpreter) warns.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")

PACKAGE = "pagellm_triton_attn"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Tolerances against float64: the kernels round probabilities to the input dtype before P @ V.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _forget_package() -> None:
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    """Triton reads TRITON_INTERPRET when a kernel is decorated and the backend reads it when
    imported, so the package is imported afresh with it set, for this module only; afterwards it
    is forgotten, and other modules import it as on a machine without the variable."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        _forget_package()
        yield
        _forget_package()


@pytest.fixture
def kernels() -> ModuleType:
    return importlib.import_module(f"{PACKAGE}.kernels")


@pytest.fixture
def backend() -> ModuleType:
    return importlib.import_module(f"{PACKAGE}.backend")


# ---------------------------------------------------------------------------- random batches


@dataclass
class Batch:
    """A step's inputs: the context before the step is already in the cache, the new tokens'
    K/V are in ``key``/``value``; every other cache slot holds NaN."""

    query: torch.Tensor  # [T, H, D], a strided view (as a slice of a fused QKV projection)
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, Hkv, block_size, D]
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    keys: list[torch.Tensor]  # per row, the whole sequence's K [seq_len, Hkv, D]
    values: list[torch.Tensor]
    query_lens: list[int]

    @property
    def num_tokens(self) -> int:
        return self.query.shape[0]

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    def common(self) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            num_reqs=self.num_reqs,
            num_actual_tokens=self.num_tokens,
            max_query_len=max(self.query_lens),
            max_seq_len=int(self.seq_lens.max()),
            query_start_loc=self.query_start_loc,
            query_start_loc_cpu=self.query_start_loc.clone(),
            seq_lens=self.seq_lens,
            seq_lens_cpu=self.seq_lens.clone(),
            block_table=self.block_table,
            slot_mapping=self.slot_mapping,
        )


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
    """``rows`` are (cached context length, new tokens); ``padding_rows`` one-token rows follow
    with seq_len 0 and slot -1, as in a padded CUDA-graph batch."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [ctx + new for ctx, new in rows] + [0] * padding_rows
    query_lens = [new for _, new in rows] + [1] * padding_rows
    blocks_per_row = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_row) + 5  # block 0 is the null block; a few spare ones
    shuffled = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_table = torch.zeros(len(seq_lens), max(max(blocks_per_row), 1), dtype=torch.int32)
    kv_cache = torch.full((2, num_blocks, num_kv_heads, block_size, head_size), float("nan"))
    kv_cache = kv_cache.to(dtype)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    keys, values, new_k, new_v, slots = [], [], [], [], []
    for row, ((ctx, _), seq_len) in enumerate(zip(rows, seq_lens, strict=False)):
        n = blocks_per_row[row]
        block_table[row, :n] = torch.tensor(shuffled[:n], dtype=torch.int32)
        del shuffled[:n]
        k, v = rand(seq_len, num_kv_heads, head_size), rand(seq_len, num_kv_heads, head_size)
        keys.append(k)
        values.append(v)
        for pos in range(seq_len):
            block, offset = int(block_table[row, pos // block_size]), pos % block_size
            if pos < ctx:
                kv_cache[0, block, :, offset] = k[pos]
                kv_cache[1, block, :, offset] = v[pos]
            else:
                slots.append(block * block_size + offset)
        new_k.append(k[ctx:])
        new_v.append(v[ctx:])
    for _ in range(padding_rows):
        new_k.append(rand(1, num_kv_heads, head_size))
        new_v.append(rand(1, num_kv_heads, head_size))
        slots.append(-1)
    num_tokens = sum(query_lens)
    # The query is a column slice of a wider tensor, as the output of a fused QKV projection.
    fused = rand(num_tokens, (num_heads + 2 * num_kv_heads) * head_size)
    query = fused[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    return Batch(
        query=query,
        key=torch.cat(new_k),
        value=torch.cat(new_v),
        kv_cache=kv_cache,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        keys=keys + [None] * padding_rows,  # type: ignore[list-item]
        values=values + [None] * padding_rows,  # type: ignore[list-item]
        query_lens=query_lens,
    )


def reference(batch: Batch, scale: float, window: int | None) -> torch.Tensor:
    """Float64 causal attention of each query token over its row's whole sequence; rows with
    no keys (padding) give zeros."""
    num_heads = batch.query.shape[1]
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    start = 0
    for row, q_len in enumerate(batch.query_lens):
        seq_len = int(batch.seq_lens[row])
        if seq_len > 0:
            group = num_heads // batch.keys[row].shape[1]
            k = batch.keys[row].double().repeat_interleave(group, dim=1)
            v = batch.values[row].double().repeat_interleave(group, dim=1)
            q = batch.query[start : start + q_len].double()
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
            k_pos = torch.arange(seq_len).unsqueeze(0)
            visible = k_pos <= q_pos
            if window is not None:
                visible &= k_pos > q_pos - window
            scores = scores.masked_fill(~visible, float("-inf"))
            out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += q_len
    return out


def assert_close_to_reference(out: torch.Tensor, batch: Batch, scale: float, window: int | None):
    assert torch.isfinite(out).all(), "some outputs were never written (still NaN)"
    expected = reference(batch, scale, window)
    tol = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def assert_new_kv_written(batch: Batch) -> None:
    """The new tokens' K/V sit at their slots bit for bit; padding slots wrote nothing."""
    block_size = batch.kv_cache.shape[3]
    live = batch.slot_mapping >= 0
    slots = batch.slot_mapping[live]
    blocks, offsets = slots // block_size, slots % block_size
    stored_k = batch.kv_cache[0, blocks, :, offsets]
    stored_v = batch.kv_cache[1, blocks, :, offsets]
    assert torch.equal(stored_k, batch.key[live])
    assert torch.equal(stored_v, batch.value[live])
    num_context = sum(int(s) for s in batch.seq_lens)
    written = (~batch.kv_cache[0, :, 0, :, 0].isnan()).sum()
    assert written == num_context, "a slot outside the batch's sequences was written"


def run_mixed(
    kernels: ModuleType,
    batch: Batch,
    scale: float,
    window: int | None,
    out: torch.Tensor | None = None,
    skip_decodes: bool = False,
) -> torch.Tensor:
    key_cache, value_cache = batch.kv_cache[0], batch.kv_cache[1]
    kernels.write_kv_cache(batch.key, batch.value, key_cache, value_cache, batch.slot_mapping)
    if out is None:
        out = torch.full(batch.query.shape, float("nan"), dtype=batch.query.dtype)
    kernels.paged_attention(
        batch.query,
        key_cache,
        value_cache,
        out,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_table,
        num_reqs=batch.num_reqs,
        num_tokens=batch.num_tokens,
        max_query_len=max(batch.query_lens),
        scale=scale,
        sliding_window=window,
        skip_decodes=skip_decodes,
    )
    return out


def run_decode(
    kernels: ModuleType,
    batch: Batch,
    scale: float,
    window: int | None,
    num_splits: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    key_cache, value_cache = batch.kv_cache[0], batch.kv_cache[1]
    kernels.write_kv_cache(batch.key, batch.value, key_cache, value_cache, batch.slot_mapping)
    num_heads, head_size = batch.query.shape[1:]
    if out is None:
        out = torch.full(batch.query.shape, float("nan"), dtype=batch.query.dtype)
    scratch = None
    if num_splits > 1:
        scratch = kernels.split_scratch(
            batch.num_reqs, num_heads, head_size, num_splits, torch.device("cpu")
        )
        for buffer in scratch:
            buffer.fill_(float("nan"))
    kernels.paged_decode(
        batch.query,
        key_cache,
        value_cache,
        out,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_table,
        num_rows=batch.num_reqs,
        scale=scale,
        sliding_window=window,
        num_splits=num_splits,
        scratch=scratch,
    )
    return out


# ---------------------------------------------------------------------------- kernels

# A prompt, a chunk after cached context, decodes (one a one-token prompt), a long chunk.
MIXED_ROWS = [(0, 37), (45, 20), (70, 1), (0, 1), (13, 1), (100, 40)]


@pytest.mark.parametrize(
    "dtype, head_size, num_heads, num_kv_heads, window, block_size",
    [
        ("fp32", 16, 4, 2, None, 16),
        ("bf16", 32, 8, 2, None, 16),
        ("fp16", 64, 4, 4, None, 32),
        ("fp32", 80, 6, 2, 24, 16),  # head size and group (3) not powers of two
        ("bf16", 16, 4, 2, 8, 32),
        ("fp16", 96, 2, 1, 50, 16),
        ("bf16", 128, 4, 2, None, 16),
        ("fp32", 256, 2, 1, 40, 16),
    ],
)
def test_mixed_batch_matches_float64_reference(
    kernels, dtype, head_size, num_heads, num_kv_heads, window, block_size
):
    batch = make_batch(
        MIXED_ROWS,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=DTYPES[dtype],
        block_size=block_size,
        seed=head_size + num_heads,
    )
    scale = head_size**-0.5
    out = run_mixed(kernels, batch, scale, window)
    assert_new_kv_written(batch)
    assert_close_to_reference(out, batch, scale, window)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # 32- and 64-key tiles
@pytest.mark.parametrize("window", [None, 7, 33])
def test_contexts_around_key_tile_boundaries(kernels, dtype, window):
    """Contexts ending just before, on and after a key-tile boundary, where the unmasked middle
    of the key range meets the masked diagonal and window edges."""
    rows = [(ctx, new) for ctx in (29, 30, 31, 32, 61, 62, 63, 64) for new in (1, 3)]
    rng = random.Random(window)
    rows += [(rng.randrange(0, 150), rng.randrange(1, 40)) for _ in range(4)]
    batch = make_batch(rows, num_heads=2, num_kv_heads=1, head_size=16, dtype=DTYPES[dtype])
    out = run_mixed(kernels, batch, 0.25, window)
    assert_close_to_reference(out, batch, 0.25, window)

    decodes = [(ctx, 1) for ctx, _ in rows]
    batch = make_batch(decodes, num_heads=2, num_kv_heads=1, head_size=16, dtype=DTYPES[dtype])
    out = run_decode(kernels, batch, 0.25, window, num_splits=3)
    assert_close_to_reference(out, batch, 0.25, window)


@pytest.mark.parametrize("window", [None, 20])
def test_mixed_kernel_alone_serves_a_decode_only_batch(kernels, window):
    # One-token tiles: a 16-row dot of which only the group's rows are real.
    rows = [(70, 1), (0, 1), (33, 1), (5, 1)]
    batch = make_batch(rows, num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    out = run_mixed(kernels, batch, 0.3, window)
    assert_close_to_reference(out, batch, 0.3, window)


@pytest.mark.parametrize(
    "dtype, head_size, num_heads, num_kv_heads, window, num_splits",
    [
        ("fp32", 16, 4, 2, None, 1),
        ("fp32", 16, 4, 2, None, 3),
        ("bf16", 32, 8, 2, None, 8),  # more splits than a short row has tiles: empty splits
        ("fp16", 64, 4, 1, 40, 4),  # sliding window: splits share only the window's tiles
        ("bf16", 128, 2, 2, None, 2),
        ("fp32", 80, 6, 2, 70, 5),
    ],
)
def test_decode_with_and_without_split_kv_matches_reference(
    kernels, dtype, head_size, num_heads, num_kv_heads, window, num_splits
):
    rows = [(300, 1), (0, 1), (63, 1), (129, 1), (16, 1)]
    batch = make_batch(
        rows,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=DTYPES[dtype],
        padding_rows=2,
        seed=num_splits,
    )
    scale = head_size**-0.5
    out = run_decode(kernels, batch, scale, window, num_splits)
    assert_new_kv_written(batch)
    assert_close_to_reference(out, batch, scale, window)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:])), "padding rows must give zeros"


@pytest.mark.parametrize("num_splits", [1, 4])
def test_mixed_batch_shared_between_the_two_kernels_matches_reference(kernels, num_splits):
    """Prompts and chunks in `paged_attention`, decode rows in `paged_decode`: each kernel
    leaves the other's rows alone (both write into one NaN-poisoned output)."""
    batch = make_batch(
        MIXED_ROWS, num_heads=8, num_kv_heads=2, head_size=32, dtype=torch.float16, seed=5
    )
    out = torch.full(batch.query.shape, float("nan"), dtype=batch.query.dtype)
    decode_tokens = batch.query_start_loc[:-1][torch.tensor(batch.query_lens) == 1]
    run_mixed(kernels, batch, 0.2, 30, out=out, skip_decodes=True)
    assert out[decode_tokens].isnan().all(), "the mixed kernel wrote a decode row"
    run_decode(kernels, batch, 0.2, 30, num_splits, out=out)
    assert_close_to_reference(out, batch, 0.2, 30)


def test_split_kv_agrees_with_unsplit_decode(kernels):
    rows = [(500, 1), (200, 1), (31, 1)]
    kwargs = dict(num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float32, seed=7)
    whole = run_decode(kernels, make_batch(rows, **kwargs), 0.125, None, 1)
    split = run_decode(kernels, make_batch(rows, **kwargs), 0.125, None, 6)
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


def test_kv_write_skips_padding_slots(kernels):
    batch = make_batch(
        [(20, 3)], num_heads=2, num_kv_heads=2, head_size=16, dtype=torch.float16, padding_rows=3
    )
    kernels.write_kv_cache(
        batch.key, batch.value, batch.kv_cache[0], batch.kv_cache[1], batch.slot_mapping
    )
    assert_new_kv_written(batch)


def test_num_decode_splits_fills_the_gpu_only_when_rows_are_few_and_long(kernels):
    split = kernels.num_decode_splits
    # 256 rows x 8 KV heads already give 2048 programs.
    assert split(256, 8, 8192, target_programs=528, min_keys=256) == 1
    # One long sequence: as many splits as the target asks, capped.
    assert split(1, 8, 32768, target_programs=528, min_keys=256) == 64
    assert split(4, 8, 32768, target_programs=528, min_keys=256) == 17
    # Short contexts are not split below min_keys keys a split.
    assert split(1, 8, 700, target_programs=528, min_keys=256) == 2
    assert split(1, 8, 100, target_programs=528, min_keys=256) == 1


# ---------------------------------------------------------------------------- backend


def spec_for(batch: Batch, window: int | None = None) -> KVCacheSpec:
    _, _, num_kv_heads, block_size, head_size = batch.kv_cache.shape
    return KVCacheSpec(block_size, num_kv_heads, head_size, batch.kv_cache.dtype, window)


def make_impl(backend: ModuleType, batch: Batch, window: int | None = None):
    num_heads, head_size = batch.query.shape[1:]
    impl_cls = backend.TritonAttentionBackend.get_impl_cls()
    return impl_cls(num_heads, head_size, head_size**-0.5, batch.kv_cache.shape[2], window)


def flat(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = batch.num_tokens
    return batch.query.reshape(n, -1), batch.key.reshape(n, -1), batch.value.reshape(n, -1)


def test_builder_picks_the_decode_kernel_for_decode_only_steps(backend):
    kwargs = dict(num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.float32)
    decodes = make_batch([(400, 1), (90, 1)], **kwargs)
    builder = backend.TritonAttentionMetadataBuilder(spec_for(decodes), torch.device("cpu"))
    builder.target_programs = 16  # as if on a GPU with a few SMs
    meta = builder.build(decodes.common())
    # 2 rows x 2 KV heads = 4 programs: 4 splits would reach 16, but 400 keys make only one
    # share of 256; with 64-key shares, 4 splits.
    assert (meta.run_decode_kernel, meta.run_mixed_kernel, meta.num_splits) == (True, False, 1)
    builder.min_keys_per_split = 64
    meta = builder.build(decodes.common())
    assert (meta.run_decode_kernel, meta.run_mixed_kernel, meta.num_splits) == (True, False, 4)
    impl = make_impl(backend, decodes)
    out = impl.forward(*flat(decodes), decodes.kv_cache, meta)
    assert_close_to_reference(out.view(decodes.query.shape), decodes, impl.scale, None)

    # A mixed batch with few decode rows: one launch; with enough of them, two.
    for min_decodes, both in ((3, False), (2, True)):
        builder.min_decodes_for_decode_kernel = min_decodes
        mixed = make_batch([(40, 9), (90, 1), (0, 5), (17, 1)], **kwargs)
        meta = builder.build(mixed.common())
        assert (meta.run_mixed_kernel, meta.run_decode_kernel) == (True, both)
        out = impl.forward(*flat(mixed), mixed.kv_cache, meta)
        assert_close_to_reference(out.view(mixed.query.shape), mixed, impl.scale, None)


def test_cudagraph_metadata_is_replayed_with_new_batch_contents(backend):
    """Capture-and-replay without a GPU: metadata built once over persistent buffers, the
    buffers rewritten in place between "replays", the same metadata reused each time."""
    kwargs = dict(num_heads=4, num_kv_heads=2, head_size=16, dtype=torch.float32, padding_rows=2)
    first = make_batch([(300, 1), (17, 1), (64, 1)], seed=1, **kwargs)
    second = make_batch([(5, 1), (260, 1), (130, 1)], seed=2, **kwargs)
    max_model_len, block_size = 512, 16
    persistent = {
        "query_start_loc": first.query_start_loc.clone(),
        "seq_lens": first.seq_lens.clone(),
        "block_table": torch.zeros(first.num_reqs, max_model_len // block_size, dtype=torch.int32),
        "slot_mapping": first.slot_mapping.clone(),
    }
    common = CommonAttentionMetadata(
        num_reqs=first.num_reqs,
        num_actual_tokens=first.num_tokens,
        max_query_len=1,
        max_seq_len=max_model_len,
        query_start_loc_cpu=first.query_start_loc.clone(),
        seq_lens_cpu=first.seq_lens.clone(),
        **persistent,
    )
    builder = backend.TritonAttentionMetadataBuilder(spec_for(first), torch.device("cpu"))
    builder.target_programs = 40
    meta = builder.build_for_cudagraph(common)
    # 5 padded rows x 2 KV heads = 10 programs: 4 splits would reach 40, but the capture-time
    # worst case (512 keys) makes two shares of 256.
    assert (meta.run_decode_kernel, meta.run_mixed_kernel, meta.num_splits) == (True, False, 2)
    impl = make_impl(backend, first)
    scratch = None
    for batch in (first, second, first):
        persistent["query_start_loc"].copy_(batch.query_start_loc)
        persistent["seq_lens"].copy_(batch.seq_lens)
        persistent["block_table"].zero_()
        persistent["block_table"][:, : batch.block_table.shape[1]] = batch.block_table
        persistent["slot_mapping"].copy_(batch.slot_mapping)
        out = impl.forward(*flat(batch), batch.kv_cache, meta).view(batch.query.shape)
        assert_close_to_reference(out, batch, impl.scale, None)
        buffers = meta.scratch.get(4, 16)
        assert scratch is None or all(a is b for a, b in zip(buffers, scratch, strict=True))
        scratch = buffers
    # A second capture of the same size shares the builder's scratch.
    assert builder.build_for_cudagraph(common).scratch is meta.scratch


def test_backend_declares_what_it_supports(backend):
    cls = backend.TritonAttentionBackend
    assert cls.is_available() is None
    assert cls.cudagraph_support
    assert cls.get_kv_cache_shape(10, 16, 8, 128) == (2, 10, 8, 16, 128)
    ok = dict(device_type="cpu", head_size=64, dtype=torch.bfloat16, block_size=32)
    assert cls.unsupported_reasons(sliding_window=4096, **ok) == []
    reasons = cls.unsupported_reasons(
        device_type="tpu", head_size=48, dtype=torch.float64, block_size=24, sliding_window=None
    )
    assert len(reasons) == 4
    assert "block_size 24 not supported (supports multiples of 16)" in reasons


# ---------------------------------------------------------------------------- end to end

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def shared_prefix_prompts() -> list[list[int]]:
    rng = random.Random(3)
    prefix = [rng.randrange(3, 1000) for _ in range(35)]
    return [prefix + [rng.randrange(3, 1000) for _ in range(n)] for n in (2, 9, 30)]


def greedy_tokens(model: str, backend_name: str, passes: int = 1) -> tuple[list, LLM]:
    llm = LLM(
        model,
        max_model_len=128,
        kv_cache_memory=4 << 20,
        max_num_batched_tokens=32,  # prompts are chunked
        enable_prefix_caching=True,
        attention_backend=backend_name,
    )
    prompts = shared_prefix_prompts()
    results = [
        [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        for _ in range(passes)
    ]
    return results, llm


@pytest.mark.parametrize(
    "kind, decodes_apart",
    [("llama3", True), ("qwen3", False), ("mistral", True)],  # mistral: sliding window 8
)
def test_greedy_outputs_match_torch_sdpa_with_chunks_and_prefix_hits(
    tiny_models, backend, kind, decodes_apart, monkeypatch
):
    builder_cls = backend.TritonAttentionMetadataBuilder
    # Thresholds lowered so that these short sequences take every path: split-KV decode, and
    # decode rows of mixed steps in the decode kernel (or, with decodes_apart False, not).
    monkeypatch.setattr(builder_cls, "min_keys_per_split", 16)
    monkeypatch.setattr(builder_cls, "programs_per_sm", 16)
    monkeypatch.setattr(builder_cls, "min_decodes_for_decode_kernel", 1 if decodes_apart else 99)
    metas = []
    build = builder_cls.build

    def recording_build(self, common):
        metas.append(build(self, common))
        return metas[-1]

    monkeypatch.setattr(builder_cls, "build", recording_build)
    expected, _ = greedy_tokens(tiny_models[kind], "TORCH_SDPA")
    assert not metas
    (first, second), llm = greedy_tokens(tiny_models[kind], "TRITON_ATTN", passes=2)
    assert first == expected[0]
    # The second pass reads the shared prefix and the first pass's prompts from the cache.
    assert second == expected[0]
    assert llm.llm_engine.engine_core.kv_cache_manager.prefix_cache_stats.hits > 0
    assert any(m.num_splits > 1 for m in metas)
    assert any(m.run_mixed_kernel and m.max_query_len < 32 for m in metas)  # a chunk's tail
    assert any(m.run_mixed_kernel and m.run_decode_kernel for m in metas) == decodes_apart
