"""Writing the step's new K/V into the paged cache, with torch's ``index_copy_``."""

from __future__ import annotations

import torch


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    padded_slots: bool,
) -> None:
    """Store ``key``/``value`` ``[T, kv_heads, head_size]`` at ``slot_mapping`` in caches of
    ``[num_blocks, block_size, kv_heads, head_size]``, where slot ``s`` is row ``s`` of the
    cache seen as ``[num_blocks * block_size, kv_heads, head_size]``.

    ``padded_slots``: ``slot_mapping`` holds -1 for the padding tokens of a captured decode
    graph, which a graph cannot leave out (that would be a data-dependent shape). They copy
    slot 0 (in the null block, which no request's K/V ever goes to) onto itself: the cache is
    left as it was."""
    for new, cache in ((key, key_cache), (value, value_cache)):
        flat = cache.view(-1, *cache.shape[2:])
        if padded_slots:
            padding = (slot_mapping < 0)[:, None, None]
            flat.index_copy_(0, slot_mapping.clamp(min=0), torch.where(padding, flat[0], new))
        else:
            flat.index_copy_(0, slot_mapping, new)
