"""Split-K's float32 partial sums, added in split order: by the last program of each output
tile to finish (`add_splits_if_last`, inside the GEMM kernel, with a counter per tile from
`tile_counters`) or by a second launch (`sum_splits_kernel`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []
"""Buffers replaced by larger ones, kept alive: a CUDA graph captured with one still uses it."""
COUNTERS_MIN = 1 << 16


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """One int32 counter per output tile for the serial split-K sum, zero between launches (the
    last program of each tile puts it back), one buffer per device. Launches on one stream only:
    two GEMMs running at the same time on two streams would share counters."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        if counters is not None:
            _OUTGROWN.append(counters)
        counters = torch.zeros(max(COUNTERS_MIN, tiles), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


@triton.jit
def add_splits_if_last(
    ws_ptr,
    cnt_ptr,
    out_ptr,
    offs_out,
    out_mask,
    stride_os,
    split_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Called by every split after writing its partial sums: the one that arrives last adds
    them all, in split order, and re-arms the tile's counter."""
    tl.debug_barrier()  # every thread's partial sums are written before the release
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == split_k - 1:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(split_k):
            # .cg: from L2, where the other programs' partial sums are, never a stale L1 line
            part = tl.load(ws_ptr + s * stride_os + offs_out, mask=out_mask, cache_modifier=".cg")
            total += part
        tl.store(out_ptr + offs_out, total.to(out_ptr.dtype.element_ty), mask=out_mask)
        tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def sum_splits_kernel(ws_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        total += tl.load(ws_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
