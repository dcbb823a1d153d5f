"""Triton kernels for paged attention, and the host functions that launch them.

The KV cache of one layer is ``[2, num_blocks, num_kv_heads, block_size, head_size]``: one block
of one KV head is a contiguous ``block_size x head_size`` tile, so a key tile of ``BLOCK_N``
tokens is ``BLOCK_N / block_size`` contiguous runs that load as wide vectors. An FP8 cache
stores its values token-minor within a page (``head_size x block_size``; `split_kv_cache` gives
the view every kernel takes), since 8-bit MMA operands must be contiguous along the reduction.

A step runs `write_kv_cache`, then one or both attention kernels:

- `write_kv_cache` (`kv_write`): scatter the new tokens' K/V into the cache at their slots
  (slots < 0 are CUDA-graph padding and are skipped).
- `paged_attention` (`mixed_batch`): any batch (prompts, chunks after cached context, decodes)
  in one launch. It can leave one-token rows to:
- `paged_decode` (`split_kv_decode`): the rows of one query token, optionally split-KV, in a
  launch that can be captured in a CUDA graph.

Both attention kernels fold key tiles into an online softmax (`online_softmax`), with launch
shapes from `launch`.
"""

from __future__ import annotations

import os

from .interpreter_compat import install_interpreter_fixes
from .kv_write import write_kv_cache
from .launch import split_kv_cache
from .mixed_batch import paged_attention
from .split_kv_decode import num_decode_splits, paged_decode, rows_longest_first, split_scratch

# Triton reads the same variable when it decorates the kernels.
if os.environ.get("TRITON_INTERPRET") == "1":
    install_interpreter_fixes()

__all__ = [
    "num_decode_splits",
    "paged_attention",
    "paged_decode",
    "rows_longest_first",
    "split_kv_cache",
    "split_scratch",
    "write_kv_cache",
]
