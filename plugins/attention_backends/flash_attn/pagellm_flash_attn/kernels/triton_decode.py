"""TRITON: the split-KV decode kernel of pagellm-triton-attn, run over this backend's KV layout.

That kernel takes any strides with a contiguous last dimension, so it reads this backend's
``[num_blocks, block_size, kv_heads, head_size]`` caches through a permuted view (``[num_blocks,
kv_heads, block_size, head_size]``, its own order) without a copy. It serves one-token rows only
and skips the others, so in a mixed step it writes the decode rows into the output a prefill
kernel produced for the other rows. Split counts and scratch follow TRITON_ATTN's builder.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from pagellm.attention.backend import CommonAttentionMetadata
from pagellm.kv_cache.spec import KVCacheSpec
from pagellm_flash_attn.kernels.base import AttentionKernel, KernelUnavailable, LayerParams

if TYPE_CHECKING:
    from pagellm_flash_attn.metadata import FlashAttnMetadata


@dataclass
class TritonDecodePlan:
    num_splits: int
    scratch: Any
    """TRITON_ATTN's ``SplitScratch`` when ``num_splits`` > 1."""
    row_order: torch.Tensor | None = None
    """int32 [rows]: the rows longest first, the order the kernel's programs take them (as in
    TRITON_ATTN; a persistent buffer rewritten before each replay in a captured graph)."""


class TritonDecodeKernel(AttentionKernel):
    name = "TRITON"
    library = "pagellm-triton-attn"
    serves_prefill = False
    decodes_into = True

    @classmethod
    def _import(cls) -> Any:
        try:
            from pagellm_triton_attn import backend
        except ImportError as exc:
            raise KernelUnavailable(
                f"pagellm-triton-attn is not installed ({exc}; "
                "pip install 'pagellm-flash-attn[triton]')"
            ) from exc
        reason = backend.TritonAttentionBackend.is_available()
        if reason:
            raise KernelUnavailable(reason)
        from pagellm_triton_attn import kernels

        return SimpleNamespace(backend=backend, kernels=kernels)

    @classmethod
    def unsupported_gpu(cls, capability: tuple[int, int]) -> str | None:
        return None  # wherever Triton compiles

    @classmethod
    def unsupported_shape(
        cls, capability: tuple[int, int], head_size: int, block_size: int
    ) -> list[str]:
        head_sizes = cls.probe().backend.TritonAttentionBackend.supported_head_sizes
        if head_sizes is not None and head_size not in head_sizes:
            return [f"TRITON's tested head sizes are {list(head_sizes)}, not {head_size}"]
        return []

    @classmethod
    def splits_kv(cls, capability: tuple[int, int]) -> bool:
        return True

    def __init__(
        self, kv_cache_spec: KVCacheSpec, device: torch.device, capability: tuple[int, int]
    ) -> None:
        super().__init__(kv_cache_spec, device, capability)
        # As TRITON_ATTN's builder: the interpreter (CPU) runs programs one after another.
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 1
        )
        # Captured graphs keep pointers into these: they live as long as the kernel.
        self._graph_scratch: dict[tuple[int, int], Any] = {}
        self._graph_orders: dict[int, torch.Tensor] = {}

    def plan_decode(
        self, common: CommonAttentionMetadata, num_decode_rows: int, for_graph: bool
    ) -> TritonDecodePlan:
        builder = self.lib.backend.TritonAttentionMetadataBuilder
        num_splits = self.lib.kernels.num_decode_splits(
            num_decode_rows,
            self.kv_cache_spec.num_kv_heads,
            common.max_seq_len,
            builder.programs_per_sm * self.num_sms,
            builder.min_keys_per_split,
        )
        scratch = None
        if num_splits > 1:
            make = self.lib.backend.SplitScratch
            if for_graph:
                key = (common.num_reqs, num_splits)
                scratch = self._graph_scratch.setdefault(key, make(*key, self.device))
            else:
                scratch = make(common.num_reqs, num_splits, self.device)
        if for_graph:
            order = self._graph_orders.setdefault(
                common.num_reqs,
                torch.arange(common.num_reqs, dtype=torch.int32, device=self.device),
            )
        else:
            order = self.lib.backend.staged_row_order(common, self.device)
            order = order.to(self.device, non_blocking=True)
        return TritonDecodePlan(num_splits, scratch, order)

    def prepare_replay(self, plan: TritonDecodePlan, common: CommonAttentionMetadata) -> None:
        assert plan.row_order is not None
        staged = self.lib.backend.staged_row_order(common, self.device)
        plan.row_order.copy_(staged, non_blocking=True)

    def decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: FlashAttnMetadata,
        layer: LayerParams,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        plan: TritonDecodePlan = meta.decode_plan
        scratch = plan.scratch.get(layer.num_heads, layer.head_size) if plan.scratch else None
        self.lib.kernels.paged_decode(
            query,
            key_cache.permute(0, 2, 1, 3),
            value_cache.permute(0, 2, 1, 3),
            out,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            num_rows=meta.num_reqs,
            scale=layer.scale,
            sliding_window=layer.sliding_window,
            num_splits=plan.num_splits,
            scratch=scratch,
            row_order=plan.row_order,
        )
        return out
