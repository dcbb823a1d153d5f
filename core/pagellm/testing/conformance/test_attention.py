"""Attention through the backend contract (`AttentionMetadataBuilder.build`,
`AttentionImpl.forward`, `CommonAttentionMetadata`): new K/V land in the cache at their slots and
nowhere else, and prefill, decode, chunked prefill, sliding window and GQA steps give TORCH_SDPA's
outputs (in float32 on the CPU, from the same inputs) within the dtype's tolerance."""

from __future__ import annotations

import pytest
import torch

from pagellm.kv_cache.fp8 import quantize_kv
from pagellm.testing.conformance.compare import ConformanceFailure
from pagellm.testing.conformance.paged import (
    FP8_SCALES,
    LayerRun,
    LayerShape,
    PagedRequests,
    assert_matches_reference,
    assert_step_matches,
    reference_outputs,
)
from pagellm.testing.conformance.probes import SLIDING_WINDOW, default_shape
from pagellm.testing.conformance.scenarios import (
    CHUNKED_PREFILL,
    DECODE,
    MIXED,
    PREFILL,
    shared_prefix,
)
from pagellm.testing.conformance.targets import BackendTarget


def _entries(cache: torch.Tensor) -> torch.Tensor:
    """The cache's entries as comparable numbers (an FP8 cache's as their bytes)."""
    return cache.view(torch.uint8) if cache.element_size() == 1 else cache


def _stored(values: torch.Tensor, shape: LayerShape) -> torch.Tensor:
    """``values`` [T, 2 Hkv D] (keys then values) as the cache stores them."""
    if shape.cache_dtype is None:
        return values.to(shape.dtype)
    width = values.shape[1] // 2
    k_scale, v_scale = FP8_SCALES
    return torch.cat(
        [quantize_kv(values[:, :width], k_scale), quantize_kv(values[:, width:], v_scale)], dim=1
    ).view(torch.uint8)


def test_kv_written_at_their_slots_and_read_back(
    backend: BackendTarget, kv_cache_dtype: str
) -> None:
    """A prompt step writes exactly its tokens' keys and values into a zeroed cache (as many
    entries changed as it has, holding those values bit for bit, wherever the layout puts them);
    then decode steps read them back through the block tables and match TORCH_SDPA. Once per
    declared KV cache dtype."""
    cls = backend.skip_unless_usable()
    shape = default_shape(backend, kv_cache_dtype=kv_cache_dtype)
    device = backend.device()
    requests = PagedRequests(DECODE, shape, shape.dtype)
    layer = LayerRun(cls, shape, requests.num_blocks, device)
    layer.kv_cache.zero_()
    prompt = requests.next_step(DECODE.steps[0], device)
    layer.forward(prompt)
    entries = _entries(layer.kv_cache).cpu()
    changed = entries[entries != 0]
    q_width = shape.num_heads * shape.head_size
    expected = _stored(prompt.fused[:, q_width:], shape)
    what = f"{backend.name} ({shape.describe()}), after a prompt step of {prompt.fused.shape[0]} tokens"
    expected_nonzero = expected[expected != 0]
    if changed.numel() != expected_nonzero.numel():
        raise ConformanceFailure(
            f"{what}: {changed.numel()} cache entries changed, but the step wrote "
            f"{expected_nonzero.numel()} nonzero keys and values: entries were written outside "
            "the step's slots, or some were not written"
        )
    if not torch.equal(changed.sort().values, expected_nonzero.flatten().sort().values):
        raise ConformanceFailure(
            f"{what}: the changed cache entries are not the step's keys and values as stored "
            "(the model dtype, or float8 quantized as pagellm.kv_cache.fp8.quantize_kv does)"
        )
    references = reference_outputs(shape, DECODE)
    for i, rows in enumerate(DECODE.steps[1:], start=1):
        inputs = requests.next_step(rows, device)
        step = f"{DECODE.name}: {backend.name}, step {i + 1} (reading them back)"
        assert_step_matches(step, shape, inputs, layer.forward(inputs), references[i])


def test_prefill_matches_the_reference(backend: BackendTarget) -> None:
    cls = backend.skip_unless_usable()
    assert_matches_reference(cls, default_shape(backend), PREFILL, backend.device())


def test_decode_matches_the_reference(backend: BackendTarget) -> None:
    cls = backend.skip_unless_usable()
    assert_matches_reference(cls, default_shape(backend), DECODE, backend.device())


def test_chunked_prefill_matches_the_reference(backend: BackendTarget) -> None:
    cls = backend.skip_unless_usable()
    assert_matches_reference(cls, default_shape(backend), CHUNKED_PREFILL, backend.device())


def test_sliding_window_matches_the_reference(backend: BackendTarget) -> None:
    cls = backend.skip_unless_usable()
    if not cls.supports_sliding_window:
        pytest.skip(f"{backend.name} declares supports_sliding_window = False")
    shape = default_shape(backend, sliding_window=SLIDING_WINDOW)
    assert_matches_reference(cls, shape, CHUNKED_PREFILL, backend.device())


@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 2), (4, 1)], ids=["gqa", "mqa"])
def test_grouped_query_attention_matches_the_reference(
    backend: BackendTarget, num_heads: int, num_kv_heads: int
) -> None:
    cls = backend.skip_unless_usable()
    shape = default_shape(backend, num_heads=num_heads, num_kv_heads=num_kv_heads)
    assert_matches_reference(cls, shape, MIXED, backend.device())


def test_prefix_blocks_written_and_read_in_one_step(backend: BackendTarget) -> None:
    """Every new K/V of a step is written before any row reads the cache (docs/plugins.md, The
    KV cache): the completions of an ``n > 1`` request share their prompt blocks from their
    first step."""
    cls = backend.skip_unless_usable()
    shape = default_shape(backend)
    assert_matches_reference(cls, shape, shared_prefix(shape.block_size), backend.device())
