"""TRITON_ATTN's metadata builder and attention layer on CPU (Triton's interpreter), and the
backend end to end in the engine, where it must give TORCH_SDPA's greedy tokens.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
from interpreted_package import interpreted
from paged_batches import Batch, assert_close_to_reference, make_batch

from pagellm import LLM, SamplingParams
from pagellm.attention.backend import CommonAttentionMetadata
from pagellm.kv_cache.spec import KVCacheSpec

# Empty splits and padding rows take log2(0) = -inf on purpose; NumPy (the interpreter) warns.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")


@pytest.fixture(scope="module")
def backend() -> Iterator[ModuleType]:
    with interpreted("backend") as module:
        yield module


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


def test_a_given_output_buffer_gets_the_rows_in_place_and_nothing_past_them(backend):
    """Piecewise graphs hand attention the first rows of a longer buffer: both kernels (a mixed
    batch with decode rows) write there, the padding rows after them stay as they were."""
    kwargs = dict(num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.float32)
    batch = make_batch([(40, 9), (90, 1), (0, 5), (17, 1), (33, 1)], **kwargs)
    builder = backend.TritonAttentionMetadataBuilder(spec_for(batch), torch.device("cpu"))
    builder.min_decodes_for_decode_kernel = 2
    meta = builder.build(batch.common())
    assert meta.run_mixed_kernel and meta.run_decode_kernel
    impl = make_impl(backend, batch)
    assert backend.TritonAttentionImpl.writes_into_output
    n, width = batch.num_tokens, batch.query.shape[1] * batch.query.shape[2]
    buffer = torch.full((n + 7, width), 5.0)
    out = impl.forward(*flat(batch), batch.kv_cache, meta, output=buffer[:n])
    assert out.data_ptr() == buffer.data_ptr()
    assert_close_to_reference(buffer[:n].view(batch.query.shape), batch, impl.scale, None)
    assert torch.equal(buffer[n:], torch.full((7, width), 5.0))


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
    # An FP8 cache is read faster in longer pages: its own default block size.
    assert cls.default_block_size_for("auto") == cls.default_block_size == 16
    assert cls.default_block_size_for("fp8_e4m3") == 64


@pytest.mark.parametrize(
    "kv_cache_dtype, block_size, expected",
    [("auto", None, 16), ("fp8", None, 64), ("fp8", 32, 32), ("auto", 64, 64)],
)
def test_the_block_size_defaults_by_cache_dtype_and_the_users_wins(
    tiny_models, backend, kv_cache_dtype, block_size, expected
):
    from pagellm.engine.args import EngineArgs

    config = EngineArgs(
        tiny_models["llama3"],
        attention_backend="TRITON_ATTN",
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        max_model_len=128,
    ).create_engine_config()
    assert config.attention_backend == "TRITON_ATTN"
    assert config.cache.block_size == expected


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
