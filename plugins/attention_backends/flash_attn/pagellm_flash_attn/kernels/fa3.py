"""FA3: the Hopper FlashAttention kernels vLLM 0.25 ships (``vllm.vllm_flash_attn``,
``flash_attn_varlen_func(..., fa_version=3)``).

Paged KV through ``block_table`` over caches of ``[num_blocks, block_size, kv_heads,
head_size]`` (block sizes in multiples of 16), row lengths from ``seqused_k``; it writes into a
given ``out``. Its split-KV heuristic (``num_splits=0``) splits long decode rows; the split count
depends only on host bounds, which a captured graph fixes at the capture-time worst case. It has
no ``seqused_q``, so it serves every row of a mixed step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from packaging.version import Version

from pagellm_flash_attn.kernels.base import (
    AttentionKernel,
    KernelUnavailable,
    LayerParams,
    dist_version,
    sm_name,
)

if TYPE_CHECKING:
    from pagellm_flash_attn.metadata import FlashAttnMetadata

MIN_VLLM = "0.25"


class FA3Kernel(AttentionKernel):
    name = "FA3"
    library = "vllm"

    @classmethod
    def _import(cls) -> Any:
        version = dist_version(cls.library)
        if version is None:
            raise KernelUnavailable(
                "vLLM is not installed (FA3 comes from vLLM 0.25's vllm.vllm_flash_attn)"
            )
        if Version(version) < Version(MIN_VLLM):
            raise KernelUnavailable(f"vLLM {version} is too old (needs >= {MIN_VLLM})")
        try:
            from vllm.vllm_flash_attn import flash_attn_interface
        except Exception as exc:  # vLLM raises ImportError, or worse, for a build without kernels
            raise KernelUnavailable(
                f"vllm.vllm_flash_attn of vLLM {version} does not import "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        if not flash_attn_interface.FA3_AVAILABLE:
            raise KernelUnavailable(
                f"vLLM {version} has no FA3 kernels ({flash_attn_interface.FA3_UNAVAILABLE_REASON})"
            )
        return flash_attn_interface

    @classmethod
    def unsupported_gpu(cls, capability: tuple[int, int]) -> str | None:
        if capability[0] != 9:
            return f"FA3 runs on sm_90 (compute capability 9.x) only, not {sm_name(capability)}"
        return None

    @classmethod
    def unsupported_shape(
        cls, capability: tuple[int, int], head_size: int, block_size: int
    ) -> list[str]:
        if not (8 <= head_size <= 256 and head_size % 8 == 0):
            return [f"FA3 takes head sizes 8..256 in multiples of 8, not {head_size}"]
        return []

    @classmethod
    def splits_kv(cls, capability: tuple[int, int]) -> bool:
        return True

    def _attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: FlashAttnMetadata,
        layer: LayerParams,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        window = None if layer.window_left is None else [layer.window_left, 0]
        self.lib.flash_attn_varlen_func(
            query,
            key_cache,
            value_cache,
            max_seqlen_q=meta.max_query_len,
            cu_seqlens_q=meta.query_start_loc,
            max_seqlen_k=meta.max_seq_len,
            seqused_k=meta.seq_lens,
            softmax_scale=layer.scale,
            causal=True,
            window_size=window,
            block_table=meta.block_table,
            out=out,
            num_splits=0,
            fa_version=3,
        )
        return out

    def prefill(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: FlashAttnMetadata,
        layer: LayerParams,
        seqused_q: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if seqused_q is not None:
            raise ValueError("FA3 cannot leave rows to another kernel (it has no seqused_q)")
        return self._attend(query, key_cache, value_cache, meta, layer, out)

    def decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: FlashAttnMetadata,
        layer: LayerParams,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        return self._attend(query, key_cache, value_cache, meta, layer, out)
