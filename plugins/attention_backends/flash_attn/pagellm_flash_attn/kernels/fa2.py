"""FA2: flash-attn 2.x (``flash_attn.flash_attn_varlen_func`` / ``flash_attn_with_kvcache``).

Its paged KV takes pages of a multiple of 256 tokens only, over caches of ``[num_blocks,
block_size, kv_heads, head_size]``. Steps with prompt rows go through the varlen kernel, which
reads row lengths from ``cu_seqlens_k`` (made once per step by `plan_prefill`); decode-only steps
through ``flash_attn_with_kvcache``, which reads ``cache_seqlens`` (capturable in a graph) and
splits long rows (``num_splits=0``: its heuristic). It has no ``seqused_q``, so it serves every
row of a mixed step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from packaging.version import Version

from pagellm.attention.backend import CommonAttentionMetadata
from pagellm_flash_attn.kernels.base import (
    AttentionKernel,
    KernelUnavailable,
    LayerParams,
    dist_version,
    sm_name,
)

if TYPE_CHECKING:
    from pagellm_flash_attn.metadata import FlashAttnMetadata

MIN_VERSION = "2.6"
PAGE_MULTIPLE = 256


class FA2Kernel(AttentionKernel):
    name = "FA2"
    library = "flash-attn"

    @classmethod
    def _import(cls) -> Any:
        version = dist_version(cls.library)
        if version is None:
            raise KernelUnavailable(
                "flash-attn 2.x is not installed (pip install 'pagellm-flash-attn[fa2]' compiles it)"
            )
        if not Version(MIN_VERSION) <= Version(version) < Version("3"):
            raise KernelUnavailable(f"flash-attn {version} is not 2.x from {MIN_VERSION} on")
        try:
            import flash_attn
        except Exception as exc:  # a build for another torch fails with OSError (undefined symbol)
            raise KernelUnavailable(
                f"flash-attn {version} does not import ({type(exc).__name__}: {exc})"
            ) from exc
        if not hasattr(flash_attn, "flash_attn_with_kvcache"):
            raise KernelUnavailable(f"flash-attn {version} has no flash_attn_with_kvcache")
        return flash_attn

    @classmethod
    def unsupported_gpu(cls, capability: tuple[int, int]) -> str | None:
        if capability < (8, 0):
            return f"FA2 runs on sm_80 and newer, not {sm_name(capability)}"
        return None

    @classmethod
    def unsupported_shape(
        cls, capability: tuple[int, int], head_size: int, block_size: int
    ) -> list[str]:
        reasons = []
        if not (8 <= head_size <= 256 and head_size % 8 == 0):
            reasons.append(f"FA2 takes head sizes 8..256 in multiples of 8, not {head_size}")
        if block_size % PAGE_MULTIPLE:
            reasons.append(
                f"FA2's paged KV takes block sizes in multiples of {PAGE_MULTIPLE}, not "
                f"{block_size} (pass --block-size {PAGE_MULTIPLE})"
            )
        return reasons

    @classmethod
    def splits_kv(cls, capability: tuple[int, int]) -> bool:
        return True

    def plan_prefill(self, common: CommonAttentionMetadata) -> torch.Tensor:
        """``cu_seqlens_k``: the varlen kernel reads row lengths from cumulative sums."""
        cu_seqlens_k = torch.zeros(common.num_reqs + 1, dtype=torch.int32, device=self.device)
        torch.cumsum(common.seq_lens, 0, dtype=torch.int32, out=cu_seqlens_k[1:])
        return cu_seqlens_k

    def _window(self, layer: LayerParams) -> tuple[int, int]:
        return (-1, -1) if layer.window_left is None else (layer.window_left, 0)

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
        # FA2's varlen call has no output argument: the caller copies into ``out``.
        if seqused_q is not None:
            raise ValueError("FA2 cannot leave rows to another kernel (it has no seqused_q)")
        return self.lib.flash_attn_varlen_func(
            query,
            key_cache,
            value_cache,
            meta.query_start_loc,
            meta.prefill_plan,
            meta.max_query_len,
            meta.max_seq_len,
            softmax_scale=layer.scale,
            causal=True,
            window_size=self._window(layer),
            block_table=meta.block_table,
        )

    def decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: FlashAttnMetadata,
        layer: LayerParams,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        # A decode-only step has one token per row, in row order: a batch of 1-token queries.
        result = self.lib.flash_attn_with_kvcache(
            query.unsqueeze(1),
            key_cache,
            value_cache,
            cache_seqlens=meta.seq_lens,
            block_table=meta.block_table,
            softmax_scale=layer.scale,
            causal=True,
            window_size=self._window(layer),
            num_splits=0,
        )
        return result.squeeze(1)
