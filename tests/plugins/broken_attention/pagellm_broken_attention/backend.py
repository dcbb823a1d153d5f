"""The reference attention under another name, breaking three of its declarations, each one a
case of the conformance kit must fail (tests/plugins/test_conformance_kit.py):

- it declares head size 64, but attends with a softmax scale of 1 at that size (wrong output);
- it declares block sizes that are multiples of 16, but refuses block size 32;
- it declares CUDA-graph support, but its metadata builder has no ``build_for_cudagraph``.

Everything else it does is TORCH_SDPA's, so the kit's other cases pass.
"""

from __future__ import annotations

import torch

from pagellm.attention.backend import AttentionImpl
from pagellm.attention.backends.torch_sdpa import TorchSDPABackend, TorchSDPAImpl


class BrokenAttentionImpl(TorchSDPAImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None,
    ) -> None:
        wrong_scale = 1.0 if head_size == 64 else scale
        super().__init__(num_heads, head_size, wrong_scale, num_kv_heads, sliding_window)


class BrokenAttentionBackend(TorchSDPABackend):
    name = "BROKEN_ATTN"
    supported_head_sizes = (32, 64)
    block_size_multiple = 16
    default_block_size = 16
    cudagraph_support = True

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return BrokenAttentionImpl

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
        if block_size == 32:
            reasons.append("block_size 32 not supported")
        return reasons
