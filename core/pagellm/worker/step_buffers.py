"""The model runner's persistent per-step input buffers.

Each step's token ids, positions, slot mapping, query start locations, sequence lengths and block
table are written into host staging arrays (numpy views of pinned tensors when the platform pins
memory) and copied into device tensors of fixed address, non-blocking. Fixed addresses are what
lets a captured CUDA graph be replayed on new inputs; pinned staging is what lets the copies
overlap with the host's work. On the CPU the device tensors are the host tensors themselves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

from pagellm.attention.backend import CommonAttentionMetadata

T = TypeVar("T", torch.Tensor, np.ndarray)


@dataclass
class StepArrays(Generic[T]):
    """One buffer per step input: tensors (host or device), or numpy views of the host ones."""

    input_ids: T
    positions: T
    slot_mapping: T
    query_start_loc: T
    seq_lens: T
    block_table: T


def _allocate(
    max_tokens: int, max_reqs: int, max_blocks: int, device: torch.device, pin: bool
) -> StepArrays[torch.Tensor]:
    def empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)

    return StepArrays(
        input_ids=empty(max_tokens, dtype=torch.int64),
        positions=empty(max_tokens, dtype=torch.int64),
        slot_mapping=empty(max_tokens, dtype=torch.int64),
        query_start_loc=empty(max_reqs + 1, dtype=torch.int32),
        seq_lens=empty(max_reqs, dtype=torch.int32),
        block_table=empty(max_reqs, max_blocks, dtype=torch.int32),
    )


class StepBuffers:
    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        device: torch.device,
        pin_memory: bool,
    ) -> None:
        self.device = device
        self.max_reqs = max_num_reqs
        self.max_blocks_per_req = max_blocks_per_req
        on_cpu = device.type == "cpu"
        self._non_blocking = pin_memory and not on_cpu
        # Graph replays pad a decode batch up to a capture size, which may exceed the token budget.
        sizes = (max(max_num_tokens, max_num_reqs), max_num_reqs, max_blocks_per_req)
        self.host_tensors = _allocate(*sizes, torch.device("cpu"), self._non_blocking)
        self.device_tensors = self.host_tensors if on_cpu else _allocate(*sizes, device, False)
        tensors = self.host_tensors
        self.host: StepArrays[np.ndarray] = StepArrays(
            *(getattr(tensors, f.name).numpy() for f in dataclasses.fields(tensors))
        )
        self._copied: torch.Event | None = None
        """Recorded after the last step's copies out of the staging buffers (non-blocking ones)."""

    def wait_until_staging_is_free(self) -> None:
        """Call before writing the staging buffers: the previous step's non-blocking copies out
        of them may still be queued on the device (behind a step in flight, under asynchronous
        scheduling), and must have read them first."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def stage_padding(self, num_tokens: int, num_reqs: int, num_padded: int) -> None:
        """Stage rows ``num_reqs..`` up to ``num_padded`` rows (and tokens) of a decode batch
        padded to a captured graph's size: one token each, ``seq_len`` 0 and slot -1, which
        kernels skip without reading the cache. (``query_start_loc[0]`` is always 0.)"""
        h = self.host
        h.input_ids[num_tokens:num_padded] = 0
        h.positions[num_tokens:num_padded] = 0
        h.slot_mapping[num_tokens:num_padded] = -1
        h.query_start_loc[num_reqs + 1 : num_padded + 1] = np.arange(num_tokens + 1, num_padded + 1)
        h.seq_lens[num_reqs:num_padded] = 0

    def attention_metadata(
        self,
        num_reqs: int,
        num_tokens: int,
        max_query_len: int,
        max_seq_len: int,
        num_block_cols: int,
    ) -> CommonAttentionMetadata:
        """Copy the staged prefixes to the device and describe them: ``num_reqs`` rows,
        ``num_tokens`` tokens and the first ``num_block_cols`` block-table columns."""
        self._copy_to_device(num_tokens, num_reqs, num_block_cols)
        d, h = self.device_tensors, self.host_tensors
        return CommonAttentionMetadata(
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=d.query_start_loc[: num_reqs + 1],
            query_start_loc_cpu=h.query_start_loc[: num_reqs + 1],
            seq_lens=d.seq_lens[:num_reqs],
            seq_lens_cpu=h.seq_lens[:num_reqs],
            block_table=d.block_table[:num_reqs, :num_block_cols],
            slot_mapping=d.slot_mapping[:num_tokens],
        )

    def _copy_to_device(self, num_tokens: int, num_reqs: int, num_block_cols: int) -> None:
        """Copy the staged prefix of every buffer; the block table only in its used columns."""
        h, d = self.host_tensors, self.device_tensors
        if h is d:
            return
        nb = self._non_blocking
        d.input_ids[:num_tokens].copy_(h.input_ids[:num_tokens], non_blocking=nb)
        d.positions[:num_tokens].copy_(h.positions[:num_tokens], non_blocking=nb)
        d.slot_mapping[:num_tokens].copy_(h.slot_mapping[:num_tokens], non_blocking=nb)
        d.query_start_loc[: num_reqs + 1].copy_(h.query_start_loc[: num_reqs + 1], non_blocking=nb)
        d.seq_lens[:num_reqs].copy_(h.seq_lens[:num_reqs], non_blocking=nb)
        d.block_table[:num_reqs, :num_block_cols].copy_(
            h.block_table[:num_reqs, :num_block_cols], non_blocking=nb
        )
        if nb:
            self._copied = torch.Event(device=self.device)
            self._copied.record()

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """A small per-step array (e.g. sampling indices) on the device. Copied through pinned
        memory without waiting: a blocking copy would wait for the step still running on the
        device, which asynchronous scheduling overlaps with this one's preparation."""
        return small_to_device(array, self.device, self._non_blocking)


def small_to_device(array: np.ndarray, device: torch.device, pinned: bool) -> torch.Tensor:
    """``array`` on ``device``; with ``pinned``, staged in pinned memory (PyTorch's caching host
    allocator keeps the block until the copy has run) and copied non-blocking."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return tensor
    if pinned:
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
