"""Dynamic per-tensor FP8 quantization of up to ``quant.ROW_MAXIMA_MAX_M`` rows in one launch:
a program per multiprocessor takes its rows' maximum, the programs meet at a grid barrier, and
each then quantizes its rows with the scale of all the maxima (`quant.per_tensor_quant_fp8`
with ``one_launch``). Opt-in (`ONE_LAUNCH_ENV`) until measured on the GPU."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagellm_fp8.kernels.rounding import (
    MIN_SCALE,
    _quantize,
    _scale_of,
    format_constants,
    num_warps_for,
)

ONE_LAUNCH_ENV = "PAGELLM_FP8_ONE_LAUNCH_QUANT"
"""``1``: dynamic per-tensor scales of up to ``ROW_MAXIMA_MAX_M`` rows on a GPU are found and
applied in one launch (`_per_tensor_quant_one_launch_kernel`) instead of two. Off by default
until the H200 measures it faster end to end."""

_SYNC: dict[torch.device, torch.Tensor] = {}
"""Per device, the grid barrier's two int32 words: programs arrived, generation."""
_MULTIPROCESSORS: dict[torch.device, int] = {}


def _grid_sync(device: torch.device) -> torch.Tensor:
    sync = _SYNC.get(device)
    if sync is None:
        sync = _SYNC[device] = torch.zeros(2, dtype=torch.int32, device=device)
    return sync


def _resident_programs(device: torch.device) -> int:
    """How many programs of the one-launch kernel surely run at once: one per multiprocessor
    on a GPU (each needs a few KiB of registers); one in Triton's interpreter, which runs the
    programs of a grid one after another (a barrier across several would never open)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return 1
    sms = _MULTIPROCESSORS.get(device)
    if sms is None:
        sms = _MULTIPROCESSORS[device] = torch.cuda.get_device_properties(
            device
        ).multi_processor_count
    return sms


def one_launch_enabled() -> bool:
    return os.environ.get(ONE_LAUNCH_ENV) == "1"


@triton.jit
def _grid_barrier(sync_ptr, PROGRAMS: tl.constexpr):
    """Every program of the grid waits here until all ``PROGRAMS`` have arrived (they must all
    be resident at once). Sense by generation: a program reads the generation before it
    arrives; the last to arrive re-arms the count and moves the generation on, which the others
    spin on. Nothing is left to reset between launches."""
    tl.debug_barrier()  # this program's earlier stores are issued before its arrival
    generation = tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu")
    arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == PROGRAMS - 1:
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(sync_ptr + 1, 1, sem="release", scope="gpu")
    else:
        while tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu") == generation:
            pass
    tl.debug_barrier()


@triton.jit
def _per_tensor_quant_one_launch_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    partial_ptr,
    sync_ptr,
    M,
    stride_x,
    stride_q,
    K: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUBNORMAL_ROUNDER: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
    HW_CAST: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    PROGRAMS: tl.constexpr,
    PROGRAMS_P2: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Rows ``pid, pid + PROGRAMS, ...`` (at most ``ROWS``) of one program: their maximum, the
    grid barrier, the scale from every program's maximum, then the same rows quantized (read
    again, from L2)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ROWS):
        row = pid + i * PROGRAMS
        mask = (offs < K) & (row < M)
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    tl.store(partial_ptr + pid, tl.max(amax, axis=0))
    _grid_barrier(sync_ptr, PROGRAMS)
    parts = tl.arange(0, PROGRAMS_P2)
    # .cg: the other programs' maxima from L2, never a stale L1 line
    maxima = tl.load(partial_ptr + parts, mask=parts < PROGRAMS, other=0.0, cache_modifier=".cg")
    scale = _scale_of(tl.max(maxima, axis=0), FP8_MAX, MIN_SCALE)
    if pid == 0:
        tl.store(scale_ptr, scale)
    for i in range(ROWS):
        row = pid + i * PROGRAMS
        mask = (offs < K) & (row < M)
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0)
        q = _quantize(
            x.to(tl.float32), scale, FP8_MAX, MIN_NORMAL, SUBNORMAL_ROUNDER, SIGNED_ZERO, HW_CAST
        )
        tl.store(
            q_ptr + row.to(tl.int64) * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask
        )


def per_tensor_quant_one_launch(
    x2: torch.Tensor, q: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Quantize ``x2`` [M, K] (0 < M, K <= ``quant.ONE_PASS_MAX_K``; the caller checks) into
    ``q`` [M, K] of ``dtype``; returns the scale [1] float32."""
    M, K = x2.shape
    programs = min(M, _resident_programs(x2.device))
    out_scale = torch.empty(1, dtype=torch.float32, device=x2.device)
    partial = torch.empty(programs, dtype=torch.float32, device=x2.device)
    block = triton.next_power_of_2(K)
    _per_tensor_quant_one_launch_kernel[(programs,)](
        x2,
        q,
        out_scale,
        partial,
        _grid_sync(x2.device),
        M,
        x2.stride(0),
        q.stride(0),
        K=K,
        **format_constants(dtype),
        MIN_SCALE=MIN_SCALE,
        BLOCK=block,
        PROGRAMS=programs,
        PROGRAMS_P2=triton.next_power_of_2(programs),
        ROWS=triton.next_power_of_2(triton.cdiv(M, programs)),  # a few compilations, not one per M
        num_warps=num_warps_for(block),
    )
    return out_scale
