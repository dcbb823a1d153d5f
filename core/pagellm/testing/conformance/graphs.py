"""Decode steps replayed from metadata built once (`AttentionMetadataBuilder.build_for_cudagraph`),
as the model runner replays captured CUDA graphs: persistent buffers padded to a capture size,
rewritten in place before each replay, `prepare_cudagraph_replay` called, padding rows (query
length 1, seq_len 0, slot -1) skipped by the kernels.

Where the platform records graphs (it overrides `Platform.capture_graph`) and has a device, the
layer's forward is really captured and replayed; elsewhere the forward runs again with the same
metadata, which checks everything but the recording.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagellm.attention.backend import AttentionBackend, CommonAttentionMetadata
from pagellm.platforms.interface import Platform
from pagellm.testing.conformance.paged import (
    LayerRun,
    LayerShape,
    PagedRequests,
    StepInputs,
    assert_step_matches,
    reference_outputs,
)
from pagellm.testing.conformance.scenarios import GRAPH_DECODE

CAPTURE_SIZE = 4
"""Rows of the captured batch: the scenario's three requests and one padding row."""
MAX_MODEL_LEN = 64


def records_graphs(platform: type[Platform] | None) -> bool:
    """The platform overrides `Platform.capture_graph` (whose default raises)."""
    if platform is None:
        return False
    return next(k for k in platform.__mro__ if "capture_graph" in vars(k)) is not Platform


class PersistentBatch:
    """The model runner's fixed-address step tensors, for a padded decode batch."""

    def __init__(self, layer: LayerRun, width: int) -> None:
        device, bs = layer.device, layer.shape.block_size
        rows = CAPTURE_SIZE
        self.fused = torch.zeros(rows, width, dtype=layer.shape.dtype, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(rows, MAX_MODEL_LEN // bs, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)

    def common(self, seq_lens_cpu: torch.Tensor, max_seq_len: int) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            num_reqs=CAPTURE_SIZE,
            num_actual_tokens=CAPTURE_SIZE,
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc=self.query_start_loc,
            query_start_loc_cpu=self.query_start_loc.cpu(),
            seq_lens=self.seq_lens,
            seq_lens_cpu=seq_lens_cpu,
            block_table=self.block_table,
            slot_mapping=self.slot_mapping,
        )

    def stage(self, inputs: StepInputs) -> CommonAttentionMetadata:
        """Write a decode step's rows in place, padding the rest; its metadata for the replay."""
        n = inputs.common.num_reqs
        self.fused[:n].copy_(inputs.fused.to(self.fused.dtype))
        self.fused[n:].zero_()
        self.seq_lens.zero_()
        self.seq_lens[:n].copy_(inputs.common.seq_lens)
        self.block_table.zero_()
        table = inputs.common.block_table
        self.block_table[:n, : table.shape[1]].copy_(table)
        self.slot_mapping.fill_(-1)
        self.slot_mapping[:n].copy_(inputs.common.slot_mapping)
        seq_lens_cpu = torch.zeros(CAPTURE_SIZE, dtype=torch.int32)
        seq_lens_cpu[:n] = inputs.common.seq_lens_cpu
        return self.common(seq_lens_cpu, int(inputs.common.max_seq_len))


def assert_graph_replays_match(
    backend: type[AttentionBackend],
    shape: LayerShape,
    device: torch.device,
    platform: type[Platform] | None,
) -> None:
    """GRAPH_DECODE: its prompts eagerly, two decode steps replayed, one more eagerly; every
    real row matches TORCH_SDPA."""
    scenario = GRAPH_DECODE
    requests = PagedRequests(scenario, shape, shape.dtype)
    layer = LayerRun(backend, shape, requests.num_blocks, device)
    references = reference_outputs(shape, scenario)
    width = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_size
    batch = PersistentBatch(layer, width)
    meta = layer.builder.build_for_cudagraph(
        batch.common(torch.zeros(CAPTURE_SIZE, dtype=torch.int32), MAX_MODEL_LEN)
    )
    query, key, value = layer.split(batch.fused)  # views: the batch's own memory

    def forward() -> torch.Tensor:
        return layer.impl.forward(query, key, value, layer.kv_cache, meta)

    for _ in range(2):  # before capture: kernels compiled, planning done; every row is padding
        forward()
    replay = _record(forward, platform, device)
    last = len(scenario.steps) - 1
    for i, rows in enumerate(scenario.steps):
        inputs = requests.next_step(rows, device)
        what = f"{scenario.name}: {backend.name}, step {i + 1} of {last + 1}"
        if i in (0, last):  # eager: the prompts, and after the replays
            assert_step_matches(what, shape, inputs, layer.forward(inputs), references[i])
            continue
        common = batch.stage(inputs)
        layer.builder.prepare_cudagraph_replay(meta, common)
        out = replay()[: inputs.common.num_reqs].float().cpu()
        assert_step_matches(f"{what} (replayed)", shape, inputs, out, references[i])


def _record(
    forward: Callable[[], torch.Tensor], platform: type[Platform] | None, device: torch.device
) -> Callable[[], torch.Tensor]:
    """A replay returning the output: recorded by the platform where it can, else re-run."""
    if platform is None or device.type == "cpu" or not records_graphs(platform):
        return forward
    platform.synchronize()
    graph_replay, output = platform.capture_graph(forward, platform.graph_pool())

    def replay() -> torch.Tensor:
        graph_replay()
        platform.synchronize()
        return output

    return replay
