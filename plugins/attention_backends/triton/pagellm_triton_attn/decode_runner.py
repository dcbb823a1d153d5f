"""TRITON_ATTN's split-KV decode kernel for other backends' KV caches.

FLASH_ATTN and FLASHINFER keep K and V as ``[num_blocks, block_size, num_kv_heads, head_size]``
("NHD"); the kernel takes any strides with a contiguous last dimension, so it reads them
through a permuted view (``[num_blocks, num_kv_heads, block_size, head_size]``, its own order)
without a copy. It serves one-token rows only and skips the others, so a backend that runs it in
a mixed step writes the decode rows into the output its prefill kernel produced for the other
rows. Split counts and scratch follow TRITON_ATTN's builder; a captured graph keeps its
scratch and its row-order buffer for as long as the runner lives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.attention.backend import CommonAttentionMetadata
from pagellm.kv_cache.spec import KVCacheSpec
from pagellm_triton_attn.backend import (
    SplitScratch,
    TritonAttentionMetadataBuilder,
    staged_row_order,
)


@dataclass
class DecodePlan:
    num_rows: int
    """Rows the kernel's grid covers: all of the step's (a graph's padded ones)."""
    num_splits: int
    scratch: SplitScratch | None
    """Where the splits meet, when ``num_splits`` > 1."""
    row_order: torch.Tensor | None
    """int32 [rows]: the rows longest first, the order the kernel's programs take them (a
    persistent buffer rewritten before each replay in a captured graph)."""


class DecodeRunner:
    def __init__(self, kv_cache_spec: KVCacheSpec, device: torch.device) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.device = device
        # As TRITON_ATTN's builder: the interpreter (CPU) runs programs one after another.
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 1
        )
        # Captured graphs keep pointers into these: they live as long as the runner.
        self._graph_scratch: dict[tuple[int, int], SplitScratch] = {}
        self._graph_orders: dict[int, torch.Tensor] = {}

    def plan(
        self, common: CommonAttentionMetadata, num_decode_rows: int, for_graph: bool
    ) -> DecodePlan:
        """For a step with ``num_decode_rows`` one-token rows (host values only: no device
        sync), or, ``for_graph``, for a captured batch (its padded rows, the capture's
        worst-case length). The grid covers every row; the kernel skips the longer ones."""
        from pagellm_triton_attn.kernels import num_decode_splits

        num_rows = common.num_reqs
        num_splits = num_decode_splits(
            num_decode_rows,
            self.kv_cache_spec.num_kv_heads,
            common.max_seq_len,
            TritonAttentionMetadataBuilder.programs_per_sm * self.num_sms,
            TritonAttentionMetadataBuilder.min_keys_per_split,
        )
        scratch = None
        if num_splits > 1:
            if for_graph:
                key = (num_rows, num_splits)
                scratch = self._graph_scratch.setdefault(key, SplitScratch(*key, self.device))
            else:
                scratch = SplitScratch(num_rows, num_splits, self.device)
        if for_graph:
            order = self._graph_orders.setdefault(
                num_rows, torch.arange(num_rows, dtype=torch.int32, device=self.device)
            )
        else:
            order = staged_row_order(common, self.device).to(self.device, non_blocking=True)
        return DecodePlan(num_rows, num_splits, scratch, order)

    def prepare_replay(self, plan: DecodePlan, common: CommonAttentionMetadata) -> None:
        """Before a captured graph's replay: this step's row order into the graph's buffer."""
        assert plan.row_order is not None
        plan.row_order.copy_(staged_row_order(common, self.device), non_blocking=True)

    def run(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        plan: DecodePlan,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Attention of the one-token rows' queries (``query`` [tokens, heads, head_size],
        indexed by ``query_start_loc``) over NHD caches, into those rows of ``out``; the other
        arguments as `CommonAttentionMetadata`'s (the step's, or a graph's persistent ones)."""
        from pagellm_triton_attn.kernels import paged_decode

        scratch = None
        if plan.scratch is not None:
            scratch = plan.scratch.get(query.shape[1], query.shape[2])
        paged_decode(
            query,
            key_cache.permute(0, 2, 1, 3),
            value_cache.permute(0, 2, 1, 3),
            out,
            query_start_loc,
            seq_lens,
            block_table,
            num_rows=plan.num_rows,
            scale=scale,
            sliding_window=sliding_window,
            num_splits=plan.num_splits,
            scratch=scratch,
            row_order=plan.row_order,
        )
        return out
