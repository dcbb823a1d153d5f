"""FLASH_ATTN: paged attention on FlashAttention, the best build importable here (FA4, FA3 or
FA2), with the decode phase on whichever importable kernel measured fastest (`phases`).

The KV cache is laid out as FlashAttention reads it, once, at allocation: per layer
``[2, num_blocks, block_size, num_kv_heads, head_size]``, K then V; no step converts it.
"""

from __future__ import annotations

import torch

from pagellm.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder
from pagellm.layers.custom_ops import get_custom_op, write_paged_kv
from pagellm_flash_attn.builder import FlashAttnMetadataBuilder
from pagellm_flash_attn.kernels import PROVIDERS, LayerParams, gpu_capability
from pagellm_flash_attn.metadata import FlashAttnMetadata
from pagellm_flash_attn.phases import NoFlashKernel, choose_phases


class FlashAttnImpl(AttentionImpl):
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
                f"FLASH_ATTN needs num_heads ({num_heads}) to be a multiple of num_kv_heads "
                f"({num_kv_heads})."
            )
        self.layer = LayerParams(num_heads, num_kv_heads, head_size, scale, sliding_window)
        # The platform's kernel (on CUDA, a Triton one), else torch's index_copy_.
        self.write_kv = get_custom_op("write_paged_kv") or write_paged_kv

    writes_into_output = True
    """Piecewise graphs' buffer: kernels that take an output tensor (FA4 past a step's first
    layer, FA3, the TRITON decode kernel) write there; others' results are copied there."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttnMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        meta, layer = attn_metadata, self.layer
        n = meta.num_actual_tokens
        q = query[:n].view(n, self.num_heads, self.head_size)
        k = key[:n].view(n, self.num_kv_heads, self.head_size)
        v = value[:n].view(n, self.num_kv_heads, self.head_size)
        into = None if output is None else output[:n].view(n, self.num_heads, self.head_size)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        self.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        prefill, decode = meta.prefill_kernel, meta.decode_kernel
        if prefill is None:
            if decode is None:
                raise ValueError("FlashAttnMetadata names no kernel for the step")
            out = decode.decode(q, key_cache, value_cache, meta, layer, into)
        else:
            out = prefill.prefill(
                q, key_cache, value_cache, meta, layer, meta.prefill_query_lens, out=into
            )
            if decode is not None:  # the one-token rows prefill left, written into its output
                decode.decode(q, key_cache, value_cache, meta, layer, out)
        if into is not None and out.data_ptr() != into.data_ptr():
            into.copy_(out)  # a kernel without an output argument (FA2, FA4's entry call)
        if output is not None:
            return output
        return out.reshape(n, self.num_heads * self.head_size)


class FlashAttnBackend(AttentionBackend):
    name = "FLASH_ATTN"
    supported_dtypes = (torch.float16, torch.bfloat16)
    # Head sizes depend on the build and the GPU (FA4 on sm_100: up to 128, and 256); the
    # providers' own rules are checked in `unsupported_reasons`.
    supported_head_sizes = None
    block_size_multiple = 16
    default_block_size = 16
    """As vLLM's (and the prefix cache's granularity). ``--block-size 128`` gives FA4 pages of a
    whole key tile, which it loads by TMA: its prefill ran at 617 TFLOP/s so on the H200, 559
    with 16-token pages (`measurements`); the TRITON decode kernel is as fast at either."""
    supports_sliding_window = True
    supported_device_types = ("cuda",)
    # The FA builds take FP8 descales, but this backend's writes and calls are for the model dtype.
    supported_kv_cache_dtypes = ("auto",)
    cudagraph_support = True

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def allocate_kv_cache(
        shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        # Zero-filled, not empty: FA4 loads whole pages, also the slots past a row's end in its
        # last page (masked, but 0 x NaN is NaN), so unwritten slots must hold finite values.
        return torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return FlashAttnImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return FlashAttnMetadataBuilder

    @classmethod
    def is_available(cls) -> str | None:
        """None when a FlashAttention build imports and runs on this GPU; else why not (each
        build's reason). Imports the builds (once per process)."""
        reasons = {k: k.unavailable_reason() for k in PROVIDERS}
        importable = [k for k, reason in reasons.items() if reason is None]
        if not importable:
            return "no FlashAttention build imports here: " + "; ".join(
                r for r in reasons.values() if r
            )
        capability = gpu_capability()
        if capability is None:
            return "no CUDA GPU is visible"
        on_this_gpu = [k.unsupported_gpu(capability) for k in importable]
        if all(on_this_gpu):
            return "; ".join(r for r in on_this_gpu if r)
        return None

    @classmethod
    def unsupported_reasons(
        cls,
        *,
        device_type: str,
        head_size: int,
        dtype: torch.dtype,
        block_size: int | None,
        sliding_window: int | None,
        kv_cache_dtype: str = "auto",
    ) -> list[str]:
        reasons = super().unsupported_reasons(
            device_type=device_type,
            head_size=head_size,
            dtype=dtype,
            block_size=block_size,
            sliding_window=sliding_window,
            kv_cache_dtype=kv_cache_dtype,
        )
        if reasons:
            return reasons
        capability = gpu_capability()
        if capability is None:  # is_available said there is a GPU
            return ["no CUDA GPU is visible"]
        try:
            choose_phases(capability, head_size, block_size or cls.default_block_size)
        except NoFlashKernel as exc:
            reasons.append(str(exc))
        return reasons
