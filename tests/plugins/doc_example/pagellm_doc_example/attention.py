# pagellm_doc_example/attention.py
"""PLAIN_TORCH: paged attention in plain torch, one request at a time.

One layer's KV cache is [2, num_blocks, block_size, num_kv_heads, head_size] (keys, then values):
cache slot s is block s // block_size, offset s % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)


@dataclass
class RequestSpan:
    start: int
    end: int
    """The request's new tokens are rows start..end-1 of the step's query, key and value."""
    context_slots: torch.Tensor
    """[seq_len] int64: the cache slots of its whole context (cached and new tokens), in order."""
    mask: torch.Tensor
    """[end - start, seq_len] bool: True where a new token attends to a context token."""


@dataclass
class PlainTorchMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor
    requests: list[RequestSpan]


class PlainTorchMetadataBuilder(AttentionMetadataBuilder):
    """Once per step, shared by every layer: each request's context slots and mask."""

    def build(self, common: CommonAttentionMetadata) -> PlainTorchMetadata:
        block_size = self.kv_cache_spec.block_size
        window = self.kv_cache_spec.sliding_window
        starts = common.query_start_loc_cpu.tolist()  # the host copies: no device sync
        requests = []
        for i, seq_len in enumerate(common.seq_lens_cpu.tolist()):
            start, end = starts[i], starts[i + 1]
            positions = torch.arange(seq_len, device=self.device)
            blocks = common.block_table[i, positions // block_size].long()
            slots = blocks * block_size + positions % block_size
            # The new tokens are the last end - start positions of the context.
            query_positions = positions[seq_len - (end - start) :, None]
            mask = positions[None, :] <= query_positions  # causal
            if window is not None:
                mask &= query_positions - positions[None, :] < window
            requests.append(RequestSpan(start, end, slots, mask))
        return PlainTorchMetadata(common.num_actual_tokens, common.slot_mapping, requests)


class PlainTorchImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: PlainTorchMetadata,
    ) -> torch.Tensor:
        n, heads, size = attn_metadata.num_tokens, self.num_heads, self.head_size
        kv_heads = self.num_kv_heads
        key_cache = kv_cache[0].view(-1, kv_heads, size)  # [num_slots, kv_heads, head_size]
        value_cache = kv_cache[1].view(-1, kv_heads, size)
        # Written first: the new tokens then attend to themselves through the cache.
        key_cache[attn_metadata.slot_mapping] = key[:n].view(n, kv_heads, size)
        value_cache[attn_metadata.slot_mapping] = value[:n].view(n, kv_heads, size)
        q = query[:n].view(n, heads, size)
        out = torch.empty_like(q)
        group = heads // kv_heads  # GQA: query head h reads KV head h // group
        for r in attn_metadata.requests:
            keys = key_cache[r.context_slots].repeat_interleave(group, dim=1)
            values = value_cache[r.context_slots].repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[r.start : r.end], keys).float() * self.scale
            probs = scores.masked_fill(~r.mask, float("-inf")).softmax(dim=-1)
            out[r.start : r.end] = torch.einsum("hqk,khd->qhd", probs.to(values.dtype), values)
        return out.view(n, heads * size)


class PlainTorchBackend(AttentionBackend):
    name = "PLAIN_TORCH"  # must equal the name its hook registers it under
    supported_device_types = ("cpu",)

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return PlainTorchImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return PlainTorchMetadataBuilder
