"""What one attention layer's KV cache looks like, independent of the backend's tensor layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    sliding_window: int | None = None

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer: keys and values."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize
