"""FlashInfer's description of a paged batch, made from pagellm's.

FlashInfer reads a batch's pages as CSR arrays: row ``i``'s pages are
``kv_indices[kv_indptr[i]:kv_indptr[i+1]]`` and its last page holds ``kv_last_page_len[i]``
tokens (1 to block_size), so its length is ``(pages - 1) * block_size + last_page_len``; a row
with no pages (a CUDA-graph padding row) has length 0, whatever its last page length. Its
queries are ``qo_indptr`` (pagellm's ``query_start_loc``).

The lengths come from the host's ``seq_lens`` (O(rows) numpy, no device sync); the page indices
are gathered on the device from the block table, so that no per-page work happens on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PagedKVIndex:
    """One step's arrays as FlashInfer's ``plan`` takes them: host tensors (pinned on a GPU),
    except ``kv_indices``, which stays on the device."""

    qo_indptr: torch.Tensor
    """int32 [rows + 1], host."""
    kv_indptr: torch.Tensor
    """int32 [rows + 1], host."""
    kv_last_page_len: torch.Tensor
    """int32 [rows], host."""
    kv_indices: torch.Tensor
    """int32 [kv_indptr[-1]], device."""
    max_query_len: int
    seq_lens: torch.Tensor
    """int32 [rows], host: each row's length, which the prefill plan copies to the device. Given
    in pinned memory, that copy is asynchronous; left to FlashInfer, it is recomputed from the
    page counts into a new pageable tensor, whose copy may wait for the device."""

    @property
    def num_rows(self) -> int:
        return self.kv_last_page_len.shape[0]


def fill_page_counts(
    seq_lens: np.ndarray, block_size: int, kv_indptr: np.ndarray, kv_last_page_len: np.ndarray
) -> int:
    """Write ``kv_indptr`` ([rows + 1]) and ``kv_last_page_len`` ([rows]) for rows of
    ``seq_lens`` tokens; returns the number of pages. Rows of length 0 get no page and a last
    page length of 1 (FlashInfer plans a row's length from these, and 0 would read as a full
    page)."""
    pages = (seq_lens + (block_size - 1)) // block_size
    kv_indptr[0] = 0
    np.cumsum(pages, out=kv_indptr[1:])
    kv_last_page_len[:] = seq_lens - (pages - 1) * block_size
    kv_last_page_len[seq_lens == 0] = 1
    return int(kv_indptr[-1])


def gather_page_indices(
    block_table: torch.Tensor, kv_indptr: torch.Tensor, num_pages: int
) -> torch.Tensor:
    """Every row's first pages of ``block_table``, concatenated: ``kv_indptr`` (int32, on the
    block table's device) says how many of each row. Page ``j`` belongs to the row whose span
    of ``kv_indptr`` holds it (a binary search) and is that row's column ``j - kv_indptr[row]``.
    Shapes come from ``num_pages`` (a host value): nothing waits for the device."""
    num_rows = block_table.shape[0]
    page = torch.arange(num_pages, dtype=torch.int32, device=block_table.device)
    row = torch.searchsorted(kv_indptr[1 : num_rows + 1], page, right=True)
    column = page - kv_indptr[row]
    return block_table[row, column]


def leading_decode_rows(qo_indptr: np.ndarray) -> int:
    """How many rows at the start of the step have one query token (decode rows: the
    scheduler puts the running requests first, so a mixed step's decodes usually lead)."""
    query_lens = np.diff(qo_indptr)
    longer = np.flatnonzero(query_lens != 1)
    return int(longer[0]) if len(longer) else len(query_lens)
