"""`DecodeGraphs` without a GPU: which sizes are captured, what a capture reads, and which graph a
step replays. CUDA graphs cannot be recorded here, so the platform's `capture_graph` stands in
for one: its "replay" runs the recorded forward pass again, which reads the persistent buffers
at their fixed addresses just as a CUDA graph replay does."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pagellm.attention.backend import AttentionMetadataBuilder, CommonAttentionMetadata
from pagellm.attention.backends.torch_sdpa import TorchSDPABackend
from pagellm.forward_context import get_forward_context
from pagellm.kv_cache.spec import KVCacheSpec
from pagellm.platforms.cpu import CpuPlatform
from pagellm.worker.cudagraphs import CapturedGraph, DecodeGraphs
from pagellm.worker.model_runner import ModelRunner
from pagellm.worker.step_buffers import StepBuffers

MAX_MODEL_LEN = 64


class ReplayingPlatform(CpuPlatform):
    @classmethod
    def capture_graph(
        cls, forward: Callable[[], torch.Tensor], pool: object
    ) -> tuple[Callable[[], None], torch.Tensor]:
        output = forward()
        return (lambda: output.copy_(forward())), output


class Model(torch.nn.Module):
    """Hidden state = token id + position + context length of the token's row: it reads the
    step's inputs and the attention metadata, as a model does."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[CommonAttentionMetadata] = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        common = get_forward_context().attn_metadata
        self.seen.append(common)
        rows = torch.arange(input_ids.shape[0])  # decode: one token per row
        return (input_ids + positions + common.seq_lens[rows]).float().unsqueeze(1)


class Builder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        return common

    def build_for_cudagraph(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        return common


class CapturableBackend(TorchSDPABackend):
    name = "CAPTURABLE_TEST"
    cudagraph_support = True


@pytest.fixture
def setup() -> tuple[DecodeGraphs, StepBuffers, Model]:
    buffers = StepBuffers(16, 8, MAX_MODEL_LEN // 4, torch.device("cpu"), pin_memory=False)
    spec = KVCacheSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32)
    graphs, model = DecodeGraphs(ReplayingPlatform), Model()
    graphs.capture(
        model,
        CapturableBackend,
        Builder(spec, torch.device("cpu")),
        buffers,
        capture_sizes=[4, 1, 2, 16],
        max_model_len=MAX_MODEL_LEN,
        pool=None,
    )
    return graphs, buffers, model


def test_sizes_that_fit_the_batch_are_captured_from_padding_rows(setup):
    graphs, _, model = setup
    assert graphs.sizes == [1, 2, 4]  # 16 exceeds the 8 rows the buffers hold
    assert sorted(graphs.captured) == [1, 2, 4]
    # Largest first, two warm-up passes then the recorded one, each over rows of padding (no
    # cache read) at the worst-case context length.
    assert [c.num_reqs for c in model.seen] == [4, 4, 4, 2, 2, 2, 1, 1, 1]
    for common in model.seen:
        assert (common.slot_mapping == -1).all() and (common.seq_lens == 0).all()
        assert common.max_seq_len == MAX_MODEL_LEN and common.max_query_len == 1
        assert common.block_table.shape == (common.num_reqs, MAX_MODEL_LEN // 4)


def test_a_decode_step_replays_the_smallest_graph_that_holds_it(setup):
    graphs, _, _ = setup
    assert graphs.for_step(num_reqs=3, num_tokens=3).size == 4
    assert graphs.for_step(num_reqs=1, num_tokens=1).size == 1
    assert graphs.for_step(num_reqs=2, num_tokens=5) is None  # not decode-only
    assert graphs.for_step(num_reqs=5, num_tokens=5) is None  # larger than every graph


def test_a_replay_reads_what_the_buffers_hold_now(setup):
    graphs, buffers, _ = setup
    graph = graphs.for_step(num_reqs=3, num_tokens=3)
    h = buffers.host
    h.input_ids[:3] = [10, 20, 30]
    h.positions[:3] = [1, 2, 3]
    h.seq_lens[:3] = [2, 3, 4]
    buffers.stage_padding(3, 3, graph.size)
    buffers.attention_metadata(graph.size, graph.size, 1, 4, 1)
    graph.replay()
    assert graph.hidden[:, 0].tolist() == [13, 25, 37, 0]


def test_a_backend_without_graph_support_is_refused():
    buffers = StepBuffers(16, 8, 4, torch.device("cpu"), pin_memory=False)
    spec = KVCacheSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="does not support CUDA graphs; pass --enforce-eager"):
        DecodeGraphs(ReplayingPlatform).capture(
            Model(), TorchSDPABackend, Builder(spec, torch.device("cpu")), buffers, [1], 16, None
        )


def test_the_runner_lets_the_builder_prepare_each_replay_first():
    """Backends that plan on the host (FLASHINFER) rewrite the buffers their graph reads in
    `prepare_cudagraph_replay`, with the step's padded batch, before the replay is launched."""
    events: list[tuple[Any, ...]] = []

    class PlanningBuilder(Builder):
        def prepare_cudagraph_replay(self, attn_metadata: Any, common: Any) -> None:
            events.append(("prepare", attn_metadata, common))

    spec = KVCacheSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32)
    runner = object.__new__(ModelRunner)  # only what `_forward` reads, without a model
    runner.attn_builder = PlanningBuilder(spec, torch.device("cpu"))
    graph = CapturedGraph(4, lambda: events.append(("replay",)), torch.zeros(4, 1), "captured")
    common = SimpleNamespace(num_reqs=4)
    hidden = runner._forward(SimpleNamespace(num_tokens=3), common, graph)
    assert events == [("prepare", "captured", common), ("replay",)]
    assert hidden.shape == (3, 1)
