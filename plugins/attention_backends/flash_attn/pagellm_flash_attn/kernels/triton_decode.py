"""TRITON: the split-KV decode kernel of pagellm-triton-attn, run over this backend's KV layout
by that package's `DecodeRunner` (a permuted view of the caches, no copy). It serves one-token
rows only and skips the others, so in a mixed step it writes the decode rows into the output a
prefill kernel produced for the other rows.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from pagellm.attention.backend import CommonAttentionMetadata
from pagellm.kv_cache.spec import KVCacheSpec
from pagellm_flash_attn.kernels.base import AttentionKernel, KernelUnavailable, LayerParams

if TYPE_CHECKING:
    from pagellm_flash_attn.metadata import FlashAttnMetadata


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
        from pagellm_triton_attn import decode_runner

        return SimpleNamespace(backend=backend, decode_runner=decode_runner)

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
        self.runner = self.lib.decode_runner.DecodeRunner(kv_cache_spec, device)

    def plan_decode(
        self, common: CommonAttentionMetadata, num_decode_rows: int, for_graph: bool
    ) -> Any:
        return self.runner.plan(common, num_decode_rows, for_graph)

    def prepare_replay(self, plan: Any, common: CommonAttentionMetadata) -> None:
        self.runner.prepare_replay(plan, common)

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
        return self.runner.run(
            query,
            key_cache,
            value_cache,
            out,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            meta.decode_plan,
            layer.scale,
            layer.sliding_window,
        )
