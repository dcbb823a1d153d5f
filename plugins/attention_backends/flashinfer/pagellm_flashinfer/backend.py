"""FLASHINFER: paged attention with FlashInfer's kernels (FA3 prefill on Hopper, tensor-core
decode), planned once per step by the metadata builder (`pagellm_flashinfer.builder`)."""

from __future__ import annotations

import torch

from pagellm.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder
from pagellm.layers.custom_ops import get_custom_op, write_paged_kv
from pagellm_flashinfer.availability import flashinfer_unavailable_reason
from pagellm_flashinfer.builder import FlashInferMetadata, FlashInferMetadataBuilder
from pagellm_flashinfer.planning import LayerParams, window_left


class FlashInferImpl(AttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None,
    ) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"FLASHINFER needs num_heads ({num_heads}) to be a multiple of num_kv_heads "
                f"({num_kv_heads})."
            )
        self.params = LayerParams(num_heads, float(scale), window_left(sliding_window))
        # The platform's kernel (on CUDA, a Triton one), else torch's index_copy_. Pages are
        # [block_size, num_kv_heads, head_size]: token-major, as the op takes them.
        self.write_kv = get_custom_op("write_paged_kv") or write_paged_kv

    writes_into_output = True
    """FlashInfer's wrappers take ``out``: piecewise graphs' buffer is written, not copied."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashInferMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        meta = attn_metadata
        meta.ensure_planned(self.params)
        n = meta.num_actual_tokens
        q = query[:n].view(n, self.num_heads, self.head_size)
        k = key[:n].view(n, self.num_kv_heads, self.head_size)
        v = value[:n].view(n, self.num_kv_heads, self.head_size)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        self.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        if output is None:
            out = torch.empty(
                n, self.num_heads, self.head_size, dtype=query.dtype, device=query.device
            )
        else:
            out = output[:n].view(n, self.num_heads, self.head_size)
        whole = len(meta.parts) == 1
        for part in meta.parts:
            rows = slice(part.start, part.end)
            part_q, part_out = (q, out) if whole else (q[rows], out[rows])
            if part.call is not None:  # the prefill wrapper (`replay`)
                part.call(part_q, key_cache, value_cache, part_out)
            else:
                part.wrapper.run(part_q, (key_cache, value_cache), out=part_out)
        return out.view(n, self.num_heads * self.head_size) if output is None else output


class FlashInferBackend(AttentionBackend):
    """The KV cache keeps the base class's zeroed allocation: slots never written hold finite
    values, whatever a kernel's tile loads past a row's end."""

    name = "FLASHINFER"
    supported_dtypes = (torch.float16, torch.bfloat16)
    # What FlashInfer's FA3 (sm_90) and FA2 kernels are built for.
    supported_head_sizes = (64, 128, 256)
    block_size_multiple = 16
    default_block_size = 16
    supports_sliding_window = True
    supported_device_types = ("cuda",)
    # FlashInfer reads FP8 caches, but this backend's plans and writes are for the model dtype.
    supported_kv_cache_dtypes = ("auto",)
    cudagraph_support = True

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        # K and V each [num_blocks, block_size, num_kv_heads, head_size]: FlashInfer's "NHD"
        # pages, with new tokens written as whole rows of slots.
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return FlashInferImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return FlashInferMetadataBuilder

    @classmethod
    def is_available(cls) -> str | None:
        return flashinfer_unavailable_reason()
