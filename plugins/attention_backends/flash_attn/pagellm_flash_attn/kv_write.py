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

    ``padded_slots``: the padding tokens of a captured decode graph (slot -1), which a graph
    cannot leave out (that would be a data-dependent shape), write into slot 0. It is in the
    null block, which pads block tables but is never a row's context, so no kernel reads it."""
    slots = slot_mapping.clamp(min=0) if padded_slots else slot_mapping
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, key)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, value)
