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
    """The model's compute dtype: queries, new keys and values, attention outputs."""
    sliding_window: int | None = None
    cache_dtype: torch.dtype | None = None
    """What the cache stores (e.g. float8_e4m3fn, with per-layer scales); None: ``dtype``."""

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype the cache tensors are allocated in."""
        return self.cache_dtype or self.dtype

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer: keys and values, in the cache's storage dtype."""
        return (
            2 * self.block_size * self.num_kv_heads * self.head_size * self.storage_dtype.itemsize
        )
