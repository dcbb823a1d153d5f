"""The `Attention` module models use: one layer's paged attention through the selected backend."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(
        self,
        backend: type[AttentionBackend],
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        causal: bool = True,
    ) -> None:
        """``causal`` False: bidirectional attention over each prompt (an encoder's), for
        backends that declare ``supports_non_causal`` (the selector chose one)."""
        super().__init__()
        if not causal and not backend.supports_non_causal:
            raise ValueError(
                f"Attention backend {backend.name} does not support non-causal attention; "
                "choose one that does (TORCH_SDPA) with --attention-backend."
            )
        self.sliding_window = sliding_window
        self.impl = backend.get_impl_cls()(
            num_heads, head_size, scale, num_kv_heads, sliding_window
        )
        self.impl.causal = causal
        # Given by the worker once the KV cache exists (`Worker.initialize_cache`).
        self.kv_cache = torch.empty(0)

    def set_kv_cache_scales(self, k_scale: float, v_scale: float) -> None:
        """Scales of a quantized KV cache (stored = value / scale), from the checkpoint."""
        self.impl.k_scale, self.impl.v_scale = k_scale, v_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention of the step's tokens; written into ``output`` (contiguous, shaped like
        ``query``) when given, in place where the backend can (`AttentionImpl.writes_into_output`)."""
        ctx = get_forward_context()
        impl = self.impl
        if ctx.attn_metadata is None:
            # Profiling run (no KV cache yet): the shapes flow on, attention itself is skipped.
            return query.contiguous() if output is None else output.copy_(query)
        if output is None:
            return impl.forward(query, key, value, self.kv_cache, ctx.attn_metadata)
        if impl.writes_into_output:
            forward: Any = impl.forward  # its signature has the ``output`` keyword
            return forward(query, key, value, self.kv_cache, ctx.attn_metadata, output=output)
        return output.copy_(impl.forward(query, key, value, self.kv_cache, ctx.attn_metadata))
