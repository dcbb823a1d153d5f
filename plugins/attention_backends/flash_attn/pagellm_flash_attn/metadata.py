"""What every attention layer of a step receives: the step's FlashAttention arrays and which
kernel serves which rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pagellm_flash_attn.kernels.base import AttentionKernel


@dataclass
class FlashAttnMetadata:
    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    """Host bounds (in a captured graph, the capture-time worst case)."""
    query_start_loc: torch.Tensor
    """``cu_seqlens_q``: int32 ``[num_reqs + 1]``."""
    seq_lens: torch.Tensor
    """``seqused_k``: int32 ``[num_reqs]``, keys each row attends to (0 for padding rows)."""
    block_table: torch.Tensor
    """``page_table``: int32 ``[num_reqs, pages]``, contiguous in its last dimension."""
    slot_mapping: torch.Tensor
    prefill_kernel: AttentionKernel | None
    """Attends every row of a step with rows of several tokens (all of them, or only those when
    ``prefill_query_lens`` is set); None in a decode-only step."""
    decode_kernel: AttentionKernel | None
    """Attends the one-token rows: every row of a decode-only step, or after ``prefill_kernel``
    the one-token rows it left; None when ``prefill_kernel`` serves them."""
    prefill_query_lens: torch.Tensor | None = None
    """``seqused_q`` for ``prefill_kernel`` when it leaves the one-token rows to
    ``decode_kernel``: each row's query length, 0 for one-token rows."""
    prefill_plan: Any = None
    """``prefill_kernel.plan_prefill``'s arrays for this step."""
    decode_plan: Any = None
    """``decode_kernel.plan_decode``'s choices for this step."""
    padded_slots: bool = False
    """``slot_mapping`` may hold -1 (the padding rows of a captured decode graph)."""
