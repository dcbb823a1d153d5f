"""FLASHINFER on the CPU: selection with the library absent, the package's registration, and the
metadata builder and attention layer against hand-checked arrays and a float64 reference.

FlashInfer's kernels need an NVIDIA GPU, so the builder and the layers run here against
`fake_flashinfer`, a stand-in put in ``sys.modules`` that records the calls it gets and attends
from what it was planned with, by FlashInfer's documented semantics: the right output means the
right index arrays. The real library is checked on the GPU (``test_flashinfer_gpu.py``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from types import ModuleType

import fake_flashinfer
import numpy as np
import pytest
import torch
from pagellm_flashinfer import plugin, replay
from pagellm_flashinfer.availability import Environment, unavailable_reason
from pagellm_flashinfer.backend import FlashInferBackend, FlashInferImpl
from pagellm_flashinfer.builder import FlashInferMetadataBuilder
from pagellm_flashinfer.jit_cache import (
    OUT_OF_DATE,
    loads_without_building,
    modules_for,
    ninja_would_rebuild,
    why_it_would_build,
)
from pagellm_flashinfer.paged_kv import fill_page_counts, gather_page_indices
from pagellm_flashinfer.planning import prefill_backend, window_left
from pagellm_flashinfer.triton_decode import (
    DECODE_VAR,
    decode_kernel_choice,
    triton_decode_runner,
)

from pagellm.attention.backend import CommonAttentionMetadata
from pagellm.attention.registry import attention_backends
from pagellm.attention.selector import NoAttentionBackendError, select_attention_backend
from pagellm.kv_cache.spec import KVCacheSpec

CUDA_RANKING = ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "TORCH_SDPA"]
"""The CUDA platform's (`pagellm_cuda.platform.CudaPlatform.attention_backend_ranking`)."""


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    # Each test starts as a process does: replays on, the first one not yet checked.
    monkeypatch.setattr(replay._State, "enabled", True)
    monkeypatch.setattr(replay._State, "checked", False)
    monkeypatch.setattr(replay._State, "reason_logged", False)
    with fake_flashinfer.installed() as module:
        yield module


@pytest.fixture(autouse=True)
def small_workspaces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FlashInferMetadataBuilder, "workspace_bytes", 1 << 10)
    monkeypatch.setattr(FlashInferMetadataBuilder, "graph_int_workspace_bytes", 1 << 10)


# ---------------------------------------------------------------------------- steps


@dataclass
class Step:
    """A step's inputs, the context before it already in the cache; unwritten slots are NaN."""

    common: CommonAttentionMetadata
    query: torch.Tensor  # [T, H * D], a column slice of a fused QKV projection
    key: torch.Tensor  # [T, Hkv * D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    keys: list[torch.Tensor]  # each real row's whole sequence [seq_len, Hkv, D]
    values: list[torch.Tensor]
    query_lens: list[int]
    num_heads: int

    @property
    def head_size(self) -> int:
        return self.kv_cache.shape[-1]


def make_step(
    rows: list[tuple[int, int]],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 8,
    block_size: int = 4,
    padding_rows: int = 0,
    block_cols: int | None = None,
    seed: int = 0,
) -> Step:
    """``rows`` are (cached context, new tokens); padding rows (one token, seq_len 0, slot -1)
    follow, as in a padded CUDA-graph batch."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in rows] + [0] * padding_rows
    query_lens = [n for _, n in rows] + [1] * padding_rows
    pages = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(pages) + 3  # block 0 is the null block, and two spare ones
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = block_cols or max(max(pages), 1)
    block_table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"))
    keys, values, new_k, new_v, slots = [], [], [], [], []
    for row, ((ctx, _), seq_len) in enumerate(zip(rows, seq_lens, strict=False)):
        block_table[row, : pages[row]] = torch.tensor(free[: pages[row]], dtype=torch.int32)
        del free[: pages[row]]
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
        keys.append(k)
        values.append(v)
        for pos in range(seq_len):
            block, offset = int(block_table[row, pos // block_size]), pos % block_size
            if pos < ctx:
                kv_cache[0, block, offset], kv_cache[1, block, offset] = k[pos], v[pos]
            else:
                slots.append(block * block_size + offset)
        new_k.append(k[ctx:])
        new_v.append(v[ctx:])
    for _ in range(padding_rows):
        new_k.append(torch.randn(1, num_kv_heads, head_size, generator=gen))
        new_v.append(torch.randn(1, num_kv_heads, head_size, generator=gen))
        slots.append(-1)
    num_tokens = sum(query_lens)
    fused = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=gen)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        num_reqs=len(seq_lens),
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=lens,
        seq_lens_cpu=lens.clone(),
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )
    return Step(
        common=common,
        query=fused[:, : num_heads * head_size],
        key=torch.cat(new_k).reshape(num_tokens, -1),
        value=torch.cat(new_v).reshape(num_tokens, -1),
        kv_cache=kv_cache,
        keys=keys,
        values=values,
        query_lens=query_lens,
        num_heads=num_heads,
    )


def reference(step: Step, scale: float, window: int | None) -> torch.Tensor:
    """Float64 causal attention of each row's new queries over its whole sequence; padding
    rows give zeros."""
    head = step.head_size
    q = step.query.reshape(-1, step.num_heads, head).double()
    out = torch.zeros_like(q)
    start = 0
    for row, q_len in enumerate(step.query_lens):
        if row < len(step.keys) and step.keys[row].shape[0]:
            seq_len = step.keys[row].shape[0]
            group = step.num_heads // step.keys[row].shape[1]
            k = step.keys[row].double().repeat_interleave(group, dim=1)
            v = step.values[row].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[start : start + q_len], k) * scale
            q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
            k_pos = torch.arange(seq_len).unsqueeze(0)
            visible = k_pos <= q_pos
            if window is not None:
                visible &= k_pos > q_pos - window
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, v)
        start += q_len
    return out


def spec_of(step: Step, window: int | None = None) -> KVCacheSpec:
    _, _, block_size, num_kv_heads, head_size = step.kv_cache.shape
    return KVCacheSpec(block_size, num_kv_heads, head_size, torch.bfloat16, window)


def impl_for(step: Step, window: int | None = None, scale: float | None = None) -> FlashInferImpl:
    head = step.head_size
    return FlashInferImpl(step.num_heads, head, scale or head**-0.5, step.kv_cache.shape[3], window)


def attend(impl: FlashInferImpl, step: Step, meta) -> torch.Tensor:
    out = impl.forward(step.query, step.key, step.value, step.kv_cache, meta)
    return out.view(-1, step.num_heads, step.head_size)


def assert_new_kv_written(step: Step) -> None:
    slots = step.common.slot_mapping
    live = slots >= 0
    flat_k = step.kv_cache[0].reshape(-1, *step.kv_cache.shape[3:])
    flat_v = step.kv_cache[1].reshape(-1, *step.kv_cache.shape[3:])
    num_tokens = step.key.shape[0]
    assert torch.equal(flat_k[slots[live]], step.key.view(num_tokens, *flat_k.shape[1:])[live])
    assert torch.equal(flat_v[slots[live]], step.value.view(num_tokens, *flat_v.shape[1:])[live])


# ---------------------------------------------------------------------------- index arrays


def test_page_counts_and_indices_by_hand():
    # Block size 4: 6 tokens (2 pages, 2 in the last), 9 (3 pages, 1), 8 (2 full pages), and a
    # padding row (no page; last page length 1 so FlashInfer does not read 0 as a full page).
    seq_lens = np.array([6, 9, 8, 0], dtype=np.int32)
    kv_indptr = np.zeros(5, dtype=np.int32)
    last = np.zeros(4, dtype=np.int32)
    assert fill_page_counts(seq_lens, 4, kv_indptr, last) == 7
    assert kv_indptr.tolist() == [0, 2, 5, 7, 7]
    assert last.tolist() == [2, 1, 4, 1]
    block_table = torch.tensor(
        [[7, 3, 0, 0], [1, 9, 4, 0], [5, 2, 0, 0], [0, 0, 0, 0]], dtype=torch.int32
    )
    indices = gather_page_indices(block_table, torch.from_numpy(kv_indptr), 7)
    assert indices.dtype == torch.int32
    assert indices.tolist() == [7, 3, 1, 9, 4, 5, 2]
    # Rows without pages anywhere, and no pages at all.
    kv_indptr = torch.tensor([0, 0, 1, 1], dtype=torch.int32)
    assert gather_page_indices(block_table[:3], kv_indptr, 1).tolist() == [1]
    assert gather_page_indices(block_table[:3], torch.zeros(4, dtype=torch.int32), 0).numel() == 0


def test_window_and_prefill_backend_choice():
    assert window_left(None) == -1
    assert window_left(128) == 127  # the query and the 127 positions before it
    assert prefill_backend((9, 0), "12.4") == "fa3"
    assert prefill_backend((9, 0), "13.0") == "fa3"
    assert prefill_backend((9, 0), "12.2") == "fa2"
    assert prefill_backend((8, 0), "12.4") == "fa2"
    assert prefill_backend((10, 0), "12.8") == "fa2"
    assert prefill_backend(None, None) == "fa2"


def test_mixed_step_is_planned_once_on_the_prefill_wrapper_with_hand_checked_arrays(fake):
    """A prompt, a decode and a chunk after cached context, in one step, block size 4: no
    decode row leads, so the prefill wrapper serves them all."""
    step = make_step([(0, 6), (8, 1), (4, 4)], num_heads=4, num_kv_heads=2, block_size=4)
    bt = torch.tensor([[7, 3, 0], [1, 9, 4], [5, 2, 0]], dtype=torch.int32)
    # The same batch with a hand-made block table (the layers are not run on it).
    common = replace(step.common, block_table=bt)
    builder = FlashInferMetadataBuilder(spec_of(step), torch.device("cpu"))
    meta = builder.build(common)
    assert not meta.decode_only
    assert meta.index.qo_indptr.tolist() == [0, 6, 7, 11]
    assert meta.index.kv_indptr.tolist() == [0, 2, 5, 7]
    assert meta.index.kv_last_page_len.tolist() == [2, 1, 4]
    assert meta.index.kv_indices.tolist() == [7, 3, 1, 9, 4, 5, 2]

    meta = builder.build(step.common)
    impl = impl_for(step)
    for _ in range(3):  # three layers, one plan
        out = attend(impl, step, meta)
    (plan,) = fake.log.named("prefill.plan")
    assert fake.log.named("decode.plan") == []
    assert [t.tolist() for t in plan.args[:2]] == [[0, 6, 7, 11], [0, 2, 5, 7]]
    assert plan.args[3].tolist() == [2, 1, 4]
    assert plan.args[4:] == (4, 2, 8, 4)  # query heads, KV heads, head size, page size
    assert plan.kwargs == dict(
        causal=True,
        sm_scale=8**-0.5,
        window_left=-1,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
        non_blocking=True,
        max_token_per_sequence=6,
        seq_lens=plan.kwargs["seq_lens"],
    )
    assert plan.kwargs["seq_lens"].tolist() == [6, 9, 8]  # host, pinned on a GPU
    # The first layer through the wrapper's run (recorded), the others replayed; the first
    # replay of the process checked against run.
    assert len(fake.log.named("prefill.run")) == 2
    assert len(fake.log.named("prefill.paged_run")) == 4
    assert_new_kv_written(step)
    torch.testing.assert_close(out.double(), reference(step, impl.scale, None))


def test_leading_decode_rows_of_a_mixed_step_go_to_the_decode_wrapper(fake):
    """Two decodes, then a prompt, a decode and a chunk, block size 4: rows 0-1 on the decode
    wrapper (tokens 0-1), rows 2-4 on the prefill wrapper (tokens 2-13) with arrays rebased to
    start at 0; each wrapper planned once for three layers."""
    step = make_step([(8, 1), (2, 1), (0, 6), (4, 1), (4, 4)], num_heads=4, block_size=4)
    bt = torch.tensor([[1, 9, 4], [6, 0, 0], [7, 3, 0], [5, 0, 0], [2, 8, 0]], dtype=torch.int32)
    builder = FlashInferMetadataBuilder(spec_of(step), torch.device("cpu"))
    meta = builder.build(replace(step.common, block_table=bt))
    assert not meta.decode_only
    decodes, prompts = meta.parts
    assert (decodes.start, decodes.end, prompts.start, prompts.end) == (0, 2, 2, 13)
    assert decodes.wrapper is builder._decode and prompts.wrapper is builder._prefill
    assert decodes.index.kv_indptr.tolist() == [0, 3, 4]
    assert decodes.index.kv_last_page_len.tolist() == [1, 3]
    assert decodes.index.kv_indices.tolist() == [1, 9, 4, 6]
    assert prompts.index.qo_indptr.tolist() == [0, 6, 7, 11]
    assert prompts.index.kv_indptr.tolist() == [0, 2, 4, 6]
    assert prompts.index.kv_last_page_len.tolist() == [2, 1, 4]
    assert prompts.index.kv_indices.tolist() == [7, 3, 5, 0, 2, 8]

    meta = builder.build(step.common)
    impl = impl_for(step)
    for _ in range(3):
        out = attend(impl, step, meta)
    (decode_plan,) = fake.log.named("decode.plan")
    (prefill_plan,) = fake.log.named("prefill.plan")
    assert decode_plan.args[0].tolist() == [0, 3, 4]
    assert prefill_plan.args[0].tolist() == [0, 6, 7, 11]
    assert prefill_plan.kwargs["max_token_per_sequence"] == 6
    assert prefill_plan.kwargs["seq_lens"].tolist() == [6, 5, 8]  # the prompt rows' own
    runs = fake.log.named("decode.run")
    assert len(runs) == 3 and runs[0].args[0] == torch.Size([2, 4, 8])
    runs = fake.log.named("prefill.paged_run")
    assert len(runs) == 4 and runs[0].args[0] == torch.Size([11, 4, 8])  # a replay checked
    assert_new_kv_written(step)
    torch.testing.assert_close(out.double(), reference(step, impl.scale, None))


def _layer(step: Step, factor: float) -> Step:
    """The same step in another layer: its own K/V cache and new K/V (the step's, times
    ``factor``), its own query (``factor`` times the step's)."""
    return replace(
        step,
        query=step.query * factor,
        key=step.key * factor,
        value=step.value * factor,
        kv_cache=step.kv_cache * factor,
        keys=[k * factor for k in step.keys],
        values=[v * factor for v in step.values],
    )


@pytest.mark.parametrize("rows", [[(0, 9), (13, 1), (4, 4)], [(13, 1), (1, 1), (0, 9), (4, 4)]])
def test_later_layers_replay_the_prefill_call_with_their_own_query_pages_and_output(fake, rows):
    """Four layers of one step, each with its own query, K/V pages and output: the first
    through the wrapper's run (its paged_run call recorded), the next ones replaying that call
    with their own four tensors (the first replay checked against run), each layer's
    attention its own."""
    step = make_step(rows, num_heads=4, block_size=4, seed=3)
    builder = FlashInferMetadataBuilder(spec_of(step), torch.device("cpu"))
    meta = builder.build(step.common)
    impl = impl_for(step)
    layers = [_layer(step, f) for f in (1.0, -0.5, 2.0, 0.25)]
    outs = [attend(impl, layer, meta) for layer in layers]
    for layer, out in zip(layers, outs, strict=True):
        assert_new_kv_written(layer)
        torch.testing.assert_close(out.double(), reference(layer, impl.scale, None))
    assert len(fake.log.named("prefill.run")) == 2  # the recorded one, the first replay's check
    assert len(fake.log.named("prefill.paged_run")) == 5
    assert replay._State.checked and replay._State.enabled
    # A second step plans again and records again; its replays are not checked again.
    fake.log.calls.clear()
    meta = builder.build(step.common)
    for layer in layers[:3]:
        attend(impl, layer, meta)
    assert len(fake.log.named("prefill.run")) == 1
    assert len(fake.log.named("prefill.paged_run")) == 3


def test_a_replay_that_differs_from_run_turns_replays_off(fake, caplog):
    """If the first replay's output is not bit for bit the wrapper's run's, the layer gets
    run's output, a warning says so, and every later call goes through run."""
    step = make_step([(0, 6), (4, 4)], num_heads=4, block_size=4, seed=5)
    builder = FlashInferMetadataBuilder(spec_of(step), torch.device("cpu"))
    meta = builder.build(step.common)
    impl = impl_for(step)
    attend(impl, step, meta)  # recorded
    (part,) = meta.parts
    real = part.call._paged_run

    def wrong(*args):
        real(*args)
        args[4].add_(1.0)  # the output

    part.call._paged_run = wrong
    with caplog.at_level(logging.WARNING, logger="pagellm_flashinfer.replay"):
        out = attend(impl, _layer(step, 0.5), meta)
    assert "differs from the wrapper's run" in caplog.text
    torch.testing.assert_close(out.double(), reference(_layer(step, 0.5), impl.scale, None))
    assert not replay._State.enabled
    fake.log.calls.clear()
    meta = builder.build(step.common)
    for factor in (1.0, 2.0):
        attend(impl, _layer(step, factor), meta)
    assert len(fake.log.named("prefill.run")) == 2  # each layer through run


def test_a_run_that_does_not_pass_its_tensors_through_is_not_replayed(fake, monkeypatch, caplog):
    """A FlashInfer whose run hands paged_run a copy of the query (another release might):
    nothing to swap, so every layer calls run, and the reason is logged once."""
    wrapper_cls = fake.BatchPrefillWithPagedKVCacheWrapper
    real_run = wrapper_cls.run

    def copying_run(self, q, paged_kv_cache, *, out):
        return real_run(self, q.clone(), paged_kv_cache, out=out)

    monkeypatch.setattr(wrapper_cls, "run", copying_run)
    step = make_step([(0, 6), (4, 4)], num_heads=4, block_size=4, seed=6)
    builder = FlashInferMetadataBuilder(spec_of(step), torch.device("cpu"))
    impl = impl_for(step)
    with caplog.at_level(logging.INFO, logger="pagellm_flashinfer.replay"):
        for _ in range(2):
            meta = builder.build(step.common)
            outs = [attend(impl, _layer(step, f), meta) for f in (1.0, 3.0)]
    assert caplog.text.count("are not each one of paged_run's arguments") == 1
    assert len(fake.log.named("prefill.run")) == 4
    for f, out in zip((1.0, 3.0), outs, strict=True):
        torch.testing.assert_close(out.double(), reference(_layer(step, f), impl.scale, None))


def test_replays_off_by_the_environment(fake, monkeypatch):
    monkeypatch.setattr(replay._State, "enabled", False)
    step = make_step([(0, 6), (4, 4)], num_heads=4, block_size=4, seed=7)
    builder = FlashInferMetadataBuilder(spec_of(step), torch.device("cpu"))
    meta = builder.build(step.common)
    impl = impl_for(step)
    for factor in (1.0, 2.0, 3.0):
        attend(impl, _layer(step, factor), meta)
    assert len(fake.log.named("prefill.run")) == 3


@pytest.mark.parametrize(
    "rows",
    [
        [(0, 17)],  # one prompt over five blocks, the last one partial
        [(0, 5), (0, 12), (0, 1)],  # prompts of every length, one of a single token
        [(9, 7), (30, 2)],  # chunks after cached context
        [(0, 9), (13, 1), (4, 4), (0, 3), (22, 1)],  # mixed, in no order
        [(13, 1), (1, 1), (0, 9), (22, 1), (4, 4)],  # mixed, decodes leading
        [(13, 1), (1, 1), (31, 1), (4, 1)],  # decode only
    ],
)
@pytest.mark.parametrize("num_kv_heads, window", [(2, None), (1, None), (2, 5)])
def test_forward_matches_reference(fake, rows, num_kv_heads, window):
    step = make_step(rows, num_heads=4, num_kv_heads=num_kv_heads, block_size=4, seed=len(rows))
    builder = FlashInferMetadataBuilder(spec_of(step, window), torch.device("cpu"))
    meta = builder.build(step.common)
    impl = impl_for(step, window)
    out = attend(impl, step, meta)
    decode_only = all(n == 1 for _, n in rows)
    assert meta.decode_only == decode_only
    leading = next((i for i, (_, n) in enumerate(rows) if n != 1), len(rows))
    planned = fake.log.named("decode.plan") + fake.log.named("prefill.plan")
    assert [c.name for c in planned] == ["decode.plan"] * (leading > 0) + ["prefill.plan"] * (
        not decode_only
    )
    assert all(plan.kwargs["window_left"] == window_left(window) for plan in planned)
    assert_new_kv_written(step)
    torch.testing.assert_close(out.double(), reference(step, impl.scale, window))


@pytest.mark.parametrize("rows", [[(13, 1), (1, 1), (0, 9), (22, 1), (4, 4)], [(13, 1), (31, 1)]])
def test_forward_writes_into_a_piecewise_graphs_buffer(fake, rows):
    """Given the output buffer (padded past the step's tokens), each wrapper's rows are written
    there, the decode part's and the prefill part's alike, and the padding is left alone."""
    assert FlashInferImpl.writes_into_output
    step = make_step(rows, num_heads=4, num_kv_heads=2, block_size=4, seed=7)
    builder = FlashInferMetadataBuilder(spec_of(step), torch.device("cpu"))
    meta = builder.build(step.common)
    impl = impl_for(step)
    tokens = step.query.shape[0]
    buffer = torch.full(
        (tokens + 5, step.num_heads * step.head_size), float("nan"), dtype=step.query.dtype
    )
    out = impl.forward(step.query, step.key, step.value, step.kv_cache, meta, output=buffer)
    assert out is buffer and torch.isnan(buffer[tokens:]).all()
    result = buffer[:tokens].view(-1, step.num_heads, step.head_size)
    torch.testing.assert_close(result.double(), reference(step, impl.scale, None))


def test_layers_must_share_heads_scale_and_window(fake):
    step = make_step([(3, 2)], num_heads=4, num_kv_heads=2)
    builder = FlashInferMetadataBuilder(spec_of(step), torch.device("cpu"))
    meta = builder.build(step.common)
    attend(impl_for(step), step, meta)
    with pytest.raises(ValueError, match="must share their query heads, softmax scale"):
        attend(impl_for(step, scale=0.5), step, meta)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        FlashInferImpl(6, 8, 0.3, 4, None)


def test_eager_decode_uses_the_tensor_core_wrapper(fake):
    step = make_step([(5, 1), (2, 1)])
    builder = FlashInferMetadataBuilder(spec_of(step), torch.device("cpu"))
    attend(impl_for(step), step, builder.build(step.common))
    inits = {c.name: c for c in fake.log.calls if c.name.endswith("__init__")}
    assert inits["decode.__init__"].kwargs == dict(use_cuda_graph=False, use_tensor_cores=True)
    assert inits["prefill.__init__"].kwargs == dict(backend="fa2")  # no Hopper here
    (plan,) = fake.log.named("decode.plan")
    assert plan.args[0].tolist() == [0, 2, 3]
    assert plan.args[2].tolist() == [2, 3]
    assert plan.kwargs["pos_encoding_mode"] == "NONE"


# ---------------------------------------------------------------------------- CUDA graphs


class PersistentBuffers:
    """The model runner's fixed-address step buffers, as a graph capture and replays see them."""

    def __init__(self, rows: int, block_cols: int) -> None:
        self.qsl = torch.arange(rows + 1, dtype=torch.int32)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32)
        self.block_table = torch.zeros(rows, block_cols, dtype=torch.int32)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64)
        self.rows, self.block_cols = rows, block_cols

    def common(self, max_seq_len: int, block_cols: int | None = None) -> CommonAttentionMetadata:
        cols = block_cols or self.block_cols
        return CommonAttentionMetadata(
            num_reqs=self.rows,
            num_actual_tokens=self.rows,
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc=self.qsl,
            query_start_loc_cpu=self.qsl.clone(),
            seq_lens=self.seq_lens,
            seq_lens_cpu=self.seq_lens.clone(),
            block_table=self.block_table[:, :cols],
            slot_mapping=self.slot_mapping,
        )

    def stage(self, step: Step) -> CommonAttentionMetadata:
        """Write a padded decode step into the buffers in place, as the runner does."""
        c = step.common
        self.seq_lens.copy_(c.seq_lens)
        self.block_table.zero_()
        self.block_table[:, : c.block_table.shape[1]] = c.block_table
        self.slot_mapping.copy_(c.slot_mapping)
        return self.common(c.max_seq_len, c.block_table.shape[1])


def two_graph_steps(
    rows: int, block_cols: int, block_size: int
) -> tuple[PersistentBuffers, Step, Step, torch.Tensor]:
    """A graph's persistent buffers, two padded decode steps of three rows to replay in them, and
    a KV cache large enough for either."""
    buffers = PersistentBuffers(rows, block_cols)
    first = make_step([(9, 1), (0, 1), (4, 1)], padding_rows=1, seed=1, block_size=block_size)
    second = make_step([(2, 1), (14, 1), (7, 1)], padding_rows=1, seed=2, block_size=block_size)
    num_blocks = max(first.kv_cache.shape[1], second.kv_cache.shape[1])
    return buffers, first, second, torch.zeros(2, num_blocks, block_size, 2, 8)


@pytest.mark.parametrize(
    "replans", [True, False], ids=["few-rows-replanned", "many-rows-planned-once"]
)
def test_graph_metadata_is_planned_at_capture_and_replanned_before_each_replay(
    fake, monkeypatch, replans
):
    """A graph of few rows x KV heads keeps split-KV and is rescheduled before each replay; one
    of many (here: the threshold set to 0) is planned once with split-KV off, and its replays
    only rewrite the index buffers."""
    if not replans:
        monkeypatch.setattr(FlashInferMetadataBuilder, "graph_split_kv_below_ctas", 0)
    rows, block_cols, block_size = 4, 8, 4
    buffers, first, second, kv_cache = two_graph_steps(rows, block_cols, block_size)
    builder = FlashInferMetadataBuilder(spec_of(first), torch.device("cpu"))

    # Capture: every row is padding, the block table at full width.
    meta = builder.build_for_cudagraph(buffers.common(max_seq_len=block_cols * block_size))
    assert meta.decode_only and meta.pads_with_null_slots
    assert meta.index.kv_indptr.tolist() == [0, 0, 0, 0, 0]
    assert meta.index.kv_last_page_len.tolist() == [1, 1, 1, 1]
    (init,) = fake.log.named("decode.__init__")[1:]  # [0] is the eager decode wrapper
    assert init.kwargs["use_cuda_graph"] and init.kwargs["use_tensor_cores"]
    indptr_buf, indices_buf, last_buf = meta.wrapper.buffers
    assert (indptr_buf.shape[0], indices_buf.shape[0], last_buf.shape[0]) == (5, 32, 4)
    (reset,) = fake.log.named("decode.reset_workspace_buffer")
    schedule_bytes = (
        FlashInferMetadataBuilder.graph_int_workspace_bytes
        if replans
        else FlashInferMetadataBuilder.graph_own_schedule_bytes
    )
    assert reset.args[1].numel() == schedule_bytes
    impl = impl_for(first)
    zeros = torch.zeros(rows, first.num_heads * 8)
    for _ in range(2):  # the warm-up passes before capture plan it
        impl.forward(zeros, zeros[:, :16], zeros[:, :16], kv_cache, meta)
    (plan,) = fake.log.named("decode.plan")
    assert plan.kwargs["disable_split_kv"] is not replans
    assert fake.log.named("fast_decode_plan") == []

    for step in (first, second):
        kv_cache.fill_(float("nan"))
        kv_cache[:, : step.kv_cache.shape[1]] = step.kv_cache
        step.kv_cache = kv_cache
        common = buffers.stage(step)
        builder.prepare_cudagraph_replay(meta, common)
        # The "replay": the same metadata, no new plan, the wrapper reading its buffers.
        out = attend(impl, step, meta)
        assert len(fake.log.named("decode.plan")) == 1
        expected = reference(step, impl.scale, None)
        torch.testing.assert_close(out.double(), expected)
        assert torch.equal(out[-1], torch.zeros_like(out[-1])), "the padding row reads nothing"
        assert_new_kv_written(step)
        # The padding token's K/V went nowhere: the null block is as it was.
        assert kv_cache[:, 0].isnan().all()

    # Second step, block size 4: 3 tokens (1 page, last 3), 15 (4 pages, last 3), 8 (2, last 4).
    assert indptr_buf.tolist() == [0, 1, 5, 7, 7]
    assert last_buf.tolist() == [3, 3, 4, 1]
    if not replans:
        assert fake.log.named("fast_decode_plan") == []
        return
    first_plan, second_plan = fake.log.named("fast_decode_plan")
    assert second_plan.args[0].tolist() == [0, 1, 5, 7, 7]
    assert second_plan.args[2].tolist() == [3, 3, 4, 1]
    assert second_plan.args[3:] == (4, 2, 8, 4)
    assert indptr_buf.tolist() == [0, 1, 5, 7, 7]
    assert last_buf.tolist() == [3, 3, 4, 1]
    assert indices_buf[:7].tolist() == second_plan.args[1].tolist()
    assert first_plan.args[0].tolist() == [0, 3, 4, 6, 6]


def test_graphs_share_index_storage_and_only_rescheduled_ones_share_a_schedule(fake, monkeypatch):
    """Every captured size takes views of one index storage. FlashInfer keeps a plan's schedule
    in the wrapper's int workspace and its kernel reads it at every replay: graphs rescheduled
    before each replay may share one, but each graph planned once needs its own, or the plans
    of the sizes captured after it overwrite the schedule it replays with (on the H200 a W2
    run's 256-row decode graph then never finished)."""
    monkeypatch.setattr(FlashInferMetadataBuilder, "graph_split_kv_below_ctas", 4)
    builder = FlashInferMetadataBuilder(KVCacheSpec(4, 2, 8, torch.float32), torch.device("cpu"))
    builder._num_sms = 1  # rows x 2 KV heads >= 4: planned once (8 and 4 rows), 1 row replans
    block_cols = 6
    sizes = (8, 4, 1)  # captured largest first, as the runner does
    buffers = {n: PersistentBuffers(n, block_cols) for n in sizes}
    metas = {n: builder.build_for_cudagraph(buffers[n].common(24)) for n in sizes}
    graphs = {n: builder._graphs[n] for n in sizes}
    assert [graphs[n].replans for n in sizes] == [False, False, True]
    assert len({m.wrapper.buffers[1].data_ptr() for m in metas.values()}) == 1
    schedules = {n: m.wrapper.int_workspace.data_ptr() for n, m in metas.items()}
    assert len(set(schedules.values())) == 3
    assert metas[1].wrapper.int_workspace.numel() == builder.graph_int_workspace_bytes

    impl = FlashInferImpl(4, 8, 8**-0.5, 2, None)
    kv_cache = torch.zeros(2, 40, 4, 2, 8)
    for n in sizes:  # each capture's warm-up pass plans its graph
        zeros = torch.zeros(n, 4 * 8)
        impl.forward(zeros, zeros[:, :16], zeros[:, :16], kv_cache, metas[n])

    # Replays of the first graph captured, after the others were planned: its own schedule.
    for seed in (1, 2):
        step = make_step([(9, 1), (0, 1), (4, 1)], padding_rows=5, block_cols=block_cols, seed=seed)
        step.query, step.key, step.value = step.query.float(), step.key.float(), step.value.float()
        kv_cache.fill_(float("nan"))
        kv_cache[:, : step.kv_cache.shape[1]] = step.kv_cache
        step.kv_cache = kv_cache
        common = buffers[8].stage(step)
        builder.prepare_cudagraph_replay(metas[8], common)
        out = attend(impl, step, metas[8])
        torch.testing.assert_close(out[:3].double(), reference(step, impl.scale, None)[:3])


# ---------------------------------------------------------------------------- JIT


def test_kernel_modules_are_compiled_once_when_the_builder_is_made(fake, caplog):
    spec = KVCacheSpec(16, 8, 128, torch.bfloat16, 4096)
    with caplog.at_level(logging.INFO, logger="pagellm_flashinfer.jit_cache"):
        FlashInferMetadataBuilder(spec, torch.device("cpu"))
        FlashInferMetadataBuilder(spec, torch.device("cpu"))
    (build,) = fake.log.named("jit.build")  # by the module's own ninja file
    assert build.args[0] == "batch_prefill_fa2_bfloat16_int32_head_128_128_swa_True"
    assert "compiling 1 kernel modules" in caplog.text and "combined" not in caplog.text
    jit_dir = fake.jit.env.FLASHINFER_JIT_DIR
    assert f"1 kernel modules found in the JIT cache {jit_dir}" in caplog.text
    # On Hopper the prefill kernels are FA3's and decode runs FA2's: two modules, one build.
    modules = modules_for("fa3", torch.float16, 64, False)
    assert [(m.backend, m.head_size, m.sliding_window) for m in modules] == [
        ("fa3", 64, False),
        ("fa2", 64, False),
    ]
    # With TRITON_ATTN's kernel on the one-token rows (the CUDA default) no decode wrapper runs.
    modules = modules_for("fa3", torch.float16, 64, False, decode_wrapper=False)
    assert [m.backend for m in modules] == ["fa3"]


def test_a_module_built_by_a_combined_build_is_rebuilt_once_at_start_up(fake, caplog):
    """FlashInfer loads a module by running its own ninja file, which rebuilds what its log
    does not record: a module compiled by ``build_jit_specs`` (one ninja run, logged in the JIT
    directory) would be compiled again at its first load, in a warm-up or a capture. It is
    rebuilt at start-up instead, and said to be; later builders find it."""
    spec = KVCacheSpec(16, 8, 128, torch.bfloat16, None)
    modules = modules_for("fa2", torch.bfloat16, 128, False)
    fake.jit.build_jit_specs([m.spec(fake) for m in modules])
    assert all(m.spec(fake).is_compiled for m in modules)
    with caplog.at_level(logging.INFO, logger="pagellm_flashinfer.jit_cache"):
        FlashInferMetadataBuilder(spec, torch.device("cpu"))
        FlashInferMetadataBuilder(spec, torch.device("cpu"))
    assert [c.args[0] for c in fake.log.named("jit.build")] == [m.spec(fake).name for m in modules]
    assert "1 of them built before by a combined build" in caplog.text
    assert "1 kernel modules found in the JIT cache" in caplog.text


@pytest.mark.skipif(fake_flashinfer.NINJA is None, reason="ninja is not on PATH")
def test_a_module_out_of_date_with_its_sources_is_rebuilt_once_at_start_up(fake, caplog):
    """A module built by its own ninja file, whose sources or headers changed since (a newer
    apache-tvm-ffi beside flashinfer), would be rebuilt by ninja at its first load, in the
    warm-up: ninja's dry run sees it at start-up, where it is rebuilt and said to be."""
    spec = KVCacheSpec(16, 8, 128, torch.bfloat16, None)
    (module,) = modules_for("fa2", torch.bfloat16, 128, False, decode_wrapper=False)
    FlashInferMetadataBuilder(spec, torch.device("cpu"))  # builds it with the real ninja
    built = module.spec(fake)
    assert loads_without_building(built) and ninja_would_rebuild(built) is False
    # The dry run holds the build's file lock, where the spec names one (FlashInfer's do).
    built.lock_path = built.build_dir.parent / f"{built.name}.lock"
    assert ninja_would_rebuild(built) is False and built.lock_path.exists()
    library = built.build_dir / f"{built.name}.so"
    earlier = built.source.stat().st_mtime - 10
    os.utime(library, (earlier, earlier))  # the library older than a header or source
    assert why_it_would_build(built) == OUT_OF_DATE
    with caplog.at_level(logging.INFO, logger="pagellm_flashinfer.jit_cache"):
        FlashInferMetadataBuilder(spec, torch.device("cpu"))
        FlashInferMetadataBuilder(spec, torch.device("cpu"))
    assert [c.args[0] for c in fake.log.named("jit.build")] == [built.name, built.name]
    assert f"; 1 of them {OUT_OF_DATE}" in caplog.text
    assert "1 kernel modules found in the JIT cache" in caplog.text  # the third builder
    assert loads_without_building(module.spec(fake))


# ---------------------------------------------------------------------------- selection


GOOD = Environment(
    version="0.6.13",
    has_tvm_ffi=True,
    has_prebuilt_kernels=False,
    nvcc="/usr/local/cuda/bin/nvcc",
    ninja="/usr/bin/ninja",
    capability=(9, 0),
)


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({}, None),
        ({"version": "0.7.1+cu130"}, None),
        (
            {"version": None},
            "flashinfer is not installed (pip install 'pagellm-flashinfer[flashinfer]')",
        ),
        ({"version": "0.6.3"}, "flashinfer-python 0.6.3 is too old (needs >= 0.6.13"),
        ({"version": "0.2.14.post1"}, "flashinfer-python 0.2.14.post1 is too old"),
        ({"has_tvm_ffi": False}, "flashinfer needs apache-tvm-ffi"),
        (
            {"nvcc": None},
            "FlashInfer compiles its kernels with nvcc on first use and none was found",
        ),
        ({"ninja": None}, "FlashInfer compiles its kernels with ninja, which is not on PATH"),
        ({"nvcc": None, "ninja": None, "has_prebuilt_kernels": True}, None),
        ({"capability": None}, "no CUDA GPU is visible"),
        ({"capability": (7, 5)}, "compute capability 7.5 is not supported (needs >= 8.0)"),
    ],
)
def test_unavailable_reasons(changes, reason):
    found = unavailable_reason(replace(GOOD, **changes))
    if reason is None:
        assert found is None
    else:
        assert found is not None and found.startswith(reason), found


@pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed here"
)
def test_cuda_ranking_passes_over_flashinfer_with_its_reason_when_it_is_absent(caplog):
    with caplog.at_level(logging.INFO, logger="pagellm.attention.selector"):
        chosen = select_attention_backend(
            requested=None,
            ranking=CUDA_RANKING,
            device_type="cuda",
            head_size=128,
            dtype=torch.bfloat16,
            block_size=None,
            sliding_window=None,
        )
    assert chosen.name in ("TRITON_ATTN", "TORCH_SDPA")
    assert "FLASHINFER rejected: flashinfer is not installed" in caplog.text
    with pytest.raises(NoAttentionBackendError, match="FLASHINFER: flashinfer is not installed"):
        select_attention_backend(
            requested="FLASHINFER",
            ranking=CUDA_RANKING,
            device_type="cuda",
            head_size=128,
            dtype=torch.bfloat16,
            block_size=None,
            sliding_window=None,
        )


def test_capabilities_refuse_what_flashinfer_does_not_build(monkeypatch):
    monkeypatch.setattr(FlashInferBackend, "is_available", classmethod(lambda cls: None))

    def reasons(**changes):
        args = dict(
            device_type="cuda",
            head_size=128,
            dtype=torch.bfloat16,
            block_size=None,
            sliding_window=None,
        )
        return FlashInferBackend.unsupported_reasons(**{**args, **changes})

    assert reasons() == []
    assert reasons(sliding_window=4096, block_size=32, dtype=torch.float16, head_size=64) == []
    assert reasons(head_size=96) == ["head size 96 not supported (supports [64, 128, 256])"]
    assert reasons(dtype=torch.float32) == [
        "dtype float32 not supported (supports ['float16', 'bfloat16'])"
    ]
    assert reasons(block_size=24) == ["block_size 24 not supported (supports multiples of 16)"]
    assert reasons(device_type="cpu") == ["device 'cpu' not supported (supports ['cuda'])"]
    assert FlashInferBackend.get_kv_cache_shape(10, 16, 8, 128) == (2, 10, 16, 8, 128)
    assert FlashInferBackend.cudagraph_support


# ---------------------------------------------------------------------------- the package


def test_the_package_registers_flashinfer_through_its_entry_point():
    (entry,) = [
        e
        for e in importlib.metadata.entry_points(group="pagellm.attention_backends")
        if e.name == "flashinfer"
    ]
    assert entry.value == "pagellm_flashinfer.plugin"
    assert entry.dist is not None and entry.dist.name == "pagellm-flashinfer"
    assert entry.load() is plugin
    assert plugin.pagellm_attention_backends() == {
        "FLASHINFER": "pagellm_flashinfer.backend:FlashInferBackend"
    }
    assert "FLASHINFER" in attention_backends.names()
    assert attention_backends.get("FLASHINFER") is FlashInferBackend
    extras = entry.dist.metadata.get_all("Provides-Extra") or []
    assert "flashinfer" in extras


# ---------------------------------------------------------------------------- TRITON_ATTN's decode


@pytest.fixture
def triton_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PAGELLM_FLASHINFER_DECODE=triton``: the one-token rows on TRITON_ATTN's decode kernel
    (Triton's interpreter here)."""
    pytest.importorskip("pagellm_triton_attn")
    monkeypatch.setenv(DECODE_VAR, "triton")


@pytest.mark.parametrize(
    ("rows", "window"),
    [
        ([(13, 1), (1, 1), (22, 1)], None),  # decode only
        ([(13, 1), (31, 1), (0, 9), (22, 1), (4, 4)], None),  # leading decodes, and a later one
        ([(0, 9), (13, 1), (4, 4)], 5),  # no leading decode row: the prefill wrapper serves all
        ([(40, 1), (3, 1)], 5),
    ],
)
def test_triton_decode_matches_reference(fake, triton_decode, rows, window):
    step = make_step(rows)
    builder = FlashInferMetadataBuilder(spec_of(step, window), torch.device("cpu"))
    meta = builder.build(step.common)
    impl = impl_for(step, window)
    out = attend(impl, step, meta)
    torch.testing.assert_close(out.double(), reference(step, impl.scale, window))
    assert_new_kv_written(step)
    # FlashInfer's decode wrapper is never planned; a decode-only step gathers no pages either.
    assert fake.log.named("decode.plan") == []
    if all(n == 1 for _, n in rows):
        assert meta.index is None and meta.decode_only and fake.log.named("prefill.plan") == []
    else:
        (plan,) = fake.log.named("prefill.plan")
        leading = next(i for i, (_, n) in enumerate(rows) if n > 1)
        assert plan.args[0].tolist()[-1] == sum(n for _, n in rows[leading:])


def test_triton_decode_graphs_replay_from_the_persistent_buffers(fake, triton_decode):
    """A captured batch: no FlashInfer wrapper, plan or page gather; before each replay only the
    row order is rewritten (longest first), into the buffer the capture's kernels read."""
    rows, block_cols, block_size = 4, 8, 4
    buffers, first, second, kv_cache = two_graph_steps(rows, block_cols, block_size)
    builder = FlashInferMetadataBuilder(spec_of(first), torch.device("cpu"))
    meta = builder.build_for_cudagraph(buffers.common(max_seq_len=block_cols * block_size))
    assert meta.decode_only and meta.pads_with_null_slots and meta.index is None
    impl = impl_for(first)
    zeros = torch.zeros(rows, first.num_heads * 8)
    impl.forward(zeros, zeros[:, :16], zeros[:, :16], kv_cache, meta)  # the capture's pass
    (part,) = meta.parts
    order = part.wrapper.plan.row_order
    for step, longest_first in ((first, [0, 2, 1, 3]), (second, [1, 2, 0, 3])):
        kv_cache.fill_(float("nan"))
        kv_cache[:, : step.kv_cache.shape[1]] = step.kv_cache
        step.kv_cache = kv_cache
        builder.prepare_cudagraph_replay(meta, buffers.stage(step))
        assert part.wrapper.plan.row_order is order and order.tolist() == longest_first
        out = attend(impl, step, meta)  # the "replay": the same metadata and buffers
        expected = reference(step, impl.scale, None)
        torch.testing.assert_close(out[:-1].double(), expected[:-1])
        assert_new_kv_written(step)
        assert kv_cache[:, 0].isnan().all(), "the padding token's K/V went to no block"
    assert fake.log.named("decode.plan") == [] and fake.log.named("fast_decode_plan") == []
    assert [c.name for c in fake.log.calls if c.name == "decode.__init__"] == ["decode.__init__"]


def test_the_decode_kernel_choice_is_checked(fake, monkeypatch):
    spec = KVCacheSpec(4, 2, 8, torch.bfloat16)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # Unset: TRITON_ATTN's kernel on CUDA where it can run (the measured faster decode), else
    # FlashInfer's wrapper; set: as asked.
    with monkeypatch.context() as patch:
        patch.setattr("pagellm_flashinfer.triton_decode.triton_unavailable_reason", lambda: None)
        assert decode_kernel_choice(cuda, {}) == "triton"
    assert decode_kernel_choice(cpu, {}) == "flashinfer"
    assert decode_kernel_choice(cuda, {DECODE_VAR: "flashinfer"}) == "flashinfer"
    assert decode_kernel_choice(cpu, {DECODE_VAR: "triton"}) == "triton"
    assert triton_decode_runner(spec, cpu, {}) is None
    with pytest.raises(ValueError, match="PAGELLM_FLASHINFER_DECODE='fa3': expected one of"):
        decode_kernel_choice(cpu, {DECODE_VAR: "fa3"})
    with monkeypatch.context() as patch:
        patch.setattr(
            "pagellm_flashinfer.triton_decode.triton_unavailable_reason", lambda: "no Triton"
        )
        assert decode_kernel_choice(cuda, {}) == "flashinfer"  # unset: falls back, no error
    monkeypatch.setenv(DECODE_VAR, "triton")
    monkeypatch.setattr(
        "pagellm_flashinfer.triton_decode.triton_unavailable_reason", lambda: "no Triton here"
    )
    with pytest.raises(ValueError, match="=triton, but TRITON_ATTN's decode kernel cannot run: no"):
        FlashInferMetadataBuilder(spec, torch.device("cpu"))
