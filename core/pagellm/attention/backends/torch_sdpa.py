"""The built-in reference attention backend: paged KV cache in plain torch, attention with SDPA.

Works wherever torch does. Decode rows (one new token) are batched into one padded SDPA call;
each prefill or prefill chunk gets its own call. Gather indices and masks are built once per
step by the metadata builder and shared by all layers. A non-causal layer (an encoder's) runs the
same prefill call without the causal mask, over a prompt the step holds whole. An FP8 cache
(``fp8_e4m3``) is quantized on write and the gathered context dequantized on read
(`pagellm.kv_cache.fp8`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pagellm.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from pagellm.kv_cache.fp8 import FP8_KV_DTYPE, dequantize_kv, quantize_kv


@dataclass
class PrefillRow:
    start: int
    end: int
    slots: torch.Tensor | None
    """Cache slots of the whole context, or None when there is no cached context (use the new K/V)."""
    mask: torch.Tensor | None
    """[query_len, context_len] bool (True = attend), or None for plain causal."""


@dataclass
class DecodeRows:
    """The rows with one new token, batched: their token indices, context slots and mask."""

    token_idx: torch.Tensor
    slots: torch.Tensor
    """[num_decodes, max_context] cache slots (padding points at the null block)."""
    mask: torch.Tensor
    """[1, num_decodes, 1, max_context] bool (broadcast over KV heads and query groups)."""


@dataclass
class TorchSDPAMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    has_context: bool = False
    """Some row attends to tokens of earlier steps (a chunk, a prefix-cache hit, a decode)."""
    decodes: DecodeRows | None = None
    prefills: list[PrefillRow] = field(default_factory=list)


class TorchSDPAMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> TorchSDPAMetadata:
        block_size = self.kv_cache_spec.block_size
        window = self.kv_cache_spec.sliding_window
        qsl = common.query_start_loc_cpu.numpy()
        seq_lens = common.seq_lens_cpu.numpy()
        query_lens = np.diff(qsl)
        block_table = common.block_table
        meta = TorchSDPAMetadata(
            common.num_actual_tokens,
            common.slot_mapping,
            has_context=bool((seq_lens > query_lens).any()),
        )

        decode_rows = np.flatnonzero(query_lens == 1)
        if len(decode_rows):
            max_len = int(seq_lens[decode_rows].max())
            pos = torch.arange(max_len, device=self.device)
            rows = torch.from_numpy(decode_rows).to(self.device)
            lens = common.seq_lens[rows].unsqueeze(1)
            blocks = block_table[rows][:, pos // block_size].long()
            decode_slots = blocks * block_size + pos % block_size
            valid = pos < lens
            if window is not None:
                valid &= pos > lens - 1 - window
            meta.decodes = DecodeRows(
                token_idx=common.query_start_loc[rows].long(),
                slots=torch.where(valid, decode_slots, 0),
                mask=valid[None, :, None, :],
            )

        for row in np.flatnonzero(query_lens > 1):
            start, end = int(qsl[row]), int(qsl[row + 1])
            q_len, seq_len = end - start, int(seq_lens[row])
            ctx = seq_len - q_len
            slots: torch.Tensor | None = None
            if ctx > 0:
                pos = torch.arange(seq_len, device=self.device)
                slots = block_table[row, pos // block_size].long() * block_size + pos % block_size
            mask: torch.Tensor | None = None
            if ctx > 0 or window is not None:
                q_pos = torch.arange(ctx, seq_len, device=self.device).unsqueeze(1)
                k_pos = torch.arange(seq_len, device=self.device).unsqueeze(0)
                mask = k_pos <= q_pos
                if window is not None:
                    mask &= q_pos - k_pos < window
            meta.prefills.append(PrefillRow(start, end, slots, mask))
        return meta


class TorchSDPAImpl(AttentionImpl):
    """The cache is head-major — [K/V, kv_head, slot, head_size] — so gathering a batch's context
    gives [kv_head, tokens, head_size] slabs that batched matmuls and SDPA read without copies."""

    def _decode(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """One new token per row against its gathered context, as two batched matmuls with the
        query heads grouped by KV head (no K/V repeat). On CPU this beats SDPA's kernel for
        single-token queries, by far in bfloat16."""
        batch, length = slots.shape
        hkv, group, dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_size
        # Row gathers (index_select along dim 0) are the fast path: one row per (head, slot).
        num_slots = key_cache.shape[1]
        head_offsets = torch.arange(hkv, device=slots.device).unsqueeze(1) * num_slots
        rows = (head_offsets + slots.reshape(1, -1)).reshape(-1)
        keys = self._read(key_cache.view(-1, dim).index_select(0, rows), self.k_scale, q.dtype)
        values = self._read(value_cache.view(-1, dim).index_select(0, rows), self.v_scale, q.dtype)
        keys = keys.view(hkv * batch, length, dim)
        values = values.view(hkv * batch, length, dim)
        grouped = q.view(batch, hkv, group, dim).transpose(0, 1).reshape(hkv * batch, group, dim)
        scores = torch.bmm(grouped, keys.transpose(1, 2)).float() * self.scale  # [Hkv*B, G, L]
        scores = scores.view(hkv, batch, group, length).masked_fill_(~mask, float("-inf"))
        probs = scores.softmax(dim=-1).to(values.dtype).view(hkv * batch, group, length)
        out = torch.bmm(probs, values).view(hkv, batch, group, dim)
        return out.transpose(0, 1).reshape(batch, self.num_heads, dim)

    @staticmethod
    def _read(cached: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """Gathered cache entries in the compute dtype."""
        return dequantize_kv(cached, scale, dtype) if cached.dtype == FP8_KV_DTYPE else cached

    def _write(
        self, cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Store ``new`` [Hkv, T, D] at ``slots``; returns it as the cache now holds it."""
        if cache.dtype != FP8_KV_DTYPE:
            cache.index_copy_(1, slots, new)
            return new
        quantized = quantize_kv(new, scale)
        # index_copy_ has no float8 kernel on CPU: copy the bytes.
        cache.view(torch.uint8).index_copy_(1, slots, quantized.view(torch.uint8))
        return dequantize_kv(quantized, scale, new.dtype)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TorchSDPAMetadata,
    ) -> torch.Tensor:
        num_tokens = attn_metadata.num_actual_tokens
        if not self.causal and attn_metadata.has_context:
            # Earlier steps' K/V were computed without the tokens after them: not bidirectional.
            raise RuntimeError(
                "A non-causal (encoder) attention layer got a step whose prompts are not whole "
                "(chunked prefill or prefix caching is on): the engine turns both off for "
                "pooling models."
            )
        q = query[:num_tokens].view(num_tokens, self.num_heads, self.head_size)
        k = key[:num_tokens].view(num_tokens, self.num_kv_heads, self.head_size).transpose(0, 1)
        v = value[:num_tokens].view(num_tokens, self.num_kv_heads, self.head_size).transpose(0, 1)
        key_cache = kv_cache[0].view(self.num_kv_heads, -1, self.head_size)
        value_cache = kv_cache[1].view(self.num_kv_heads, -1, self.head_size)
        # A prompt without cached context attends to its new K/V as stored, so that it matches
        # the same prompt read back from the cache (chunked, or after a prefix-cache hit).
        k = self._write(key_cache, attn_metadata.slot_mapping, k, self.k_scale)
        v = self._write(value_cache, attn_metadata.slot_mapping, v, self.v_scale)

        out = torch.empty_like(q)
        gqa = self.num_heads != self.num_kv_heads
        decodes = attn_metadata.decodes
        if decodes is not None:
            out[decodes.token_idx] = self._decode(
                q[decodes.token_idx], key_cache, value_cache, decodes.slots, decodes.mask
            )
        for row in attn_metadata.prefills:
            pq = q[row.start : row.end].transpose(0, 1)  # [H, Lq, D]
            if row.slots is None:
                pk, pv = k[:, row.start : row.end], v[:, row.start : row.end]
            else:
                pk = self._read(key_cache.index_select(1, row.slots), self.k_scale, q.dtype)
                pv = self._read(value_cache.index_select(1, row.slots), self.v_scale, q.dtype)
            # A leading batch dimension of 1 lets torch pick its fused CPU kernel.
            pout = F.scaled_dot_product_attention(
                pq.unsqueeze(0),
                pk.unsqueeze(0),
                pv.unsqueeze(0),
                attn_mask=row.mask,
                is_causal=row.mask is None and self.causal,
                scale=self.scale,
                enable_gqa=gqa,
            )[0]
            out[row.start : row.end] = pout.transpose(0, 1)
        return out.view(num_tokens, self.num_heads * self.head_size)


class TorchSDPABackend(AttentionBackend):
    name = "TORCH_SDPA"
    supports_non_causal = True
    supported_device_types = ("cpu", "cuda")
    supported_kv_cache_dtypes = ("auto", "fp8_e4m3")

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_size)

    @staticmethod
    def allocate_kv_cache(
        shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        # Only the null block is ever read before being written (decode padding points at it);
        # leaving the rest unfilled lets the OS hand pages out lazily.
        cache = torch.empty(shape, dtype=dtype, device=device)
        cache[:, :, 0].zero_()
        return cache

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchSDPAImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return TorchSDPAMetadataBuilder
