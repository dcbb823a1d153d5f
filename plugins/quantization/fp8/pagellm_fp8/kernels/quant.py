"""Fused FP8 activation quantization: per token (one scale per row), per tensor, and per token
group (one scale per row and group of columns, what the block-scaled GEMM takes).

Doing this with torch ops (abs, amax, div, clamp, cast) costs five passes and five launches over
the activations, about 270 us per Llama-8B layer at serving batch sizes; these kernels read each
element once (per token, per group) or twice (per tensor, whose scale needs the whole tensor).
Every kernel rounds as `pagellm_fp8.kernels.rounding` says; a per-tensor scale of a decode-sized
batch may also be found and applied in one launch (`pagellm_fp8.kernels.one_launch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm_fp8.kernels.checks import (
    ACTIVATION_DTYPES,
    FP8_DTYPE,
    Fp8KernelInputError,
    require_dtype,
    require_fp8_format,
    rows_of,
)
from pagellm_fp8.kernels.one_launch import one_launch_enabled, per_tensor_quant_one_launch
from pagellm_fp8.kernels.rounding import (
    MIN_SCALE,
    _quantize,
    _scale_of,
    format_constants,
    num_warps_for,
)

# A layer's K is fixed: kernels take it as a constant (one compilation per layer shape, known
# trip counts; Triton's interpreter also cannot loop to a bound passed as an argument).
# Rows up to this many elements are read once, held in registers; longer ones are read twice.
ONE_PASS_MAX_K = 16384
TWO_PASS_BLOCK = 4096
# Elements per program of the per-tensor and per-group kernels (a few KiB, enough to stream).
CHUNK = 2048
# Per-tensor scales of up to this many rows (decode and small mixed steps) come from one
# maximum per row, which every program of the quantization pass reduces again: no zeroed
# buffer and no atomics. Larger tensors take one atomic maximum per chunk.
ROW_MAXIMA_MAX_M = 1024


@triton.jit
def _per_token_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
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
    ONE_PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        scale = _scale_of(tl.max(tl.abs(x), axis=0), FP8_MAX, MIN_SCALE)
        q = _quantize(x, scale, FP8_MAX, MIN_NORMAL, SUBNORMAL_ROUNDER, SIGNED_ZERO, HW_CAST)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, K, BLOCK):
            mask = start + offs < K
            x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = _scale_of(tl.max(amax, axis=0), FP8_MAX, MIN_SCALE)
        for start in range(0, K, BLOCK):
            mask = start + offs < K
            x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
            q = _quantize(x, scale, FP8_MAX, MIN_NORMAL, SUBNORMAL_ROUNDER, SIGNED_ZERO, HW_CAST)
            tl.store(q_row + start + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def per_token_quant_fp8(
    x: torch.Tensor, dtype: torch.dtype = FP8_DTYPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [..., K] (bf16, fp16 or fp32) to the float8 format ``dtype`` with one
    scale per row: ``(q [..., K], scales [..., 1] float32)``, ``x ~= q.float() * scales``."""
    require_dtype("x", x, ACTIVATION_DTYPES)
    require_fp8_format(dtype)
    x2 = rows_of("x", x)
    M, K = x2.shape
    q = torch.empty((M, K), dtype=dtype, device=x.device)
    scales = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M > 0:
        one_pass = K <= ONE_PASS_MAX_K
        block = triton.next_power_of_2(K) if one_pass else TWO_PASS_BLOCK
        _per_token_quant_kernel[(M,)](
            x2,
            q,
            scales,
            x2.stride(0),
            q.stride(0),
            K=K,
            **format_constants(dtype),
            MIN_SCALE=MIN_SCALE,
            BLOCK=block,
            ONE_PASS=one_pass,
            num_warps=num_warps_for(block),
        )
    return q.view(x.shape), scales.view(*x.shape[:-1], 1)


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, K, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
    # Every value is >= 0, so the float maximum needs no NaN or sign handling.
    tl.atomic_max(amax_ptr, tl.max(tl.abs(x), axis=0))


@triton.jit
def _row_amax_kernel(x_ptr, row_max_ptr, K, stride_x, BLOCK: tl.constexpr):
    """One row's max |x| (the whole row in one block) into ``row_max[row]``."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
    tl.store(row_max_ptr + row, tl.max(tl.abs(x), axis=0))


@triton.jit
def _per_tensor_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    amax_ptr,
    M,
    K,
    stride_x,
    stride_q,
    FP8_MAX: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUBNORMAL_ROUNDER: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
    HW_CAST: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    FROM_AMAX: tl.constexpr,
    ROW_MAXIMA: tl.constexpr,
):
    """``FROM_AMAX``: the scale from ``amax_ptr``, one value, or with ``ROW_MAXIMA`` the M
    values (at most ``ROW_MAXIMA`` of them) of `_row_amax_kernel`, reduced by every program
    alike; else the static scale at ``scale_ptr``."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if FROM_AMAX:
        if ROW_MAXIMA > 0:
            rows = tl.arange(0, ROW_MAXIMA)
            amax = tl.max(tl.load(amax_ptr + rows, mask=rows < M, other=0.0), axis=0)
        else:
            amax = tl.load(amax_ptr)
        scale = _scale_of(amax, FP8_MAX, MIN_SCALE)
        if (row == 0) & (chunk == 0):
            tl.store(scale_ptr, scale)
    else:
        scale = tl.load(scale_ptr)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    q = _quantize(x, scale, FP8_MAX, MIN_NORMAL, SUBNORMAL_ROUNDER, SIGNED_ZERO, HW_CAST)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def per_tensor_quant_fp8(
    x: torch.Tensor,
    scale: torch.Tensor | None = None,
    dtype: torch.dtype = FP8_DTYPE,
    one_launch: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [..., K] to the float8 format ``dtype`` with one scale: ``(q [..., K],
    scale [1] float32)``. With ``scale`` given (static activation scales from a checkpoint: a
    float32 tensor of one element) it is used as is; without, it is ``max(amax(|x|) / FP8_MAX,
    MIN_SCALE)``, found by a first pass over ``x``: one maximum per row for up to
    ``ROW_MAXIMA_MAX_M`` rows of up to ``ONE_PASS_MAX_K`` elements (two launches in all), else
    an atomic maximum per chunk into a zeroed value (three). ``one_launch`` (by default
    `one_launch_enabled`) finds and applies a scale of up to ``ROW_MAXIMA_MAX_M`` rows in a
    single launch, its programs meeting at a grid barrier."""
    require_dtype("x", x, ACTIVATION_DTYPES)
    require_fp8_format(dtype)
    x2 = rows_of("x", x)
    M, K = x2.shape
    q = torch.empty((M, K), dtype=dtype, device=x.device)
    if one_launch is None:
        one_launch = one_launch_enabled()
    if scale is None and one_launch and 0 < M <= ROW_MAXIMA_MAX_M and K <= ONE_PASS_MAX_K:
        return q.view(x.shape), per_tensor_quant_one_launch(x2, q, dtype)
    if scale is None:
        out_scale = torch.empty(1, dtype=torch.float32, device=x.device)
        if M == 0:
            amax = out_scale.fill_(MIN_SCALE)
        elif M <= ROW_MAXIMA_MAX_M and K <= ONE_PASS_MAX_K:
            row_max = torch.empty(M, dtype=torch.float32, device=x.device)
            block = triton.next_power_of_2(K)
            _row_amax_kernel[(M,)](
                x2, row_max, K, x2.stride(0), BLOCK=block, num_warps=num_warps_for(block)
            )
            return _quantize_per_tensor(x2, q, out_scale, row_max, dtype, ROW_MAXIMA_MAX_M, x.shape)
        else:
            amax = torch.zeros(1, dtype=torch.float32, device=x.device)
            _amax_kernel[(M, triton.cdiv(K, CHUNK))](
                x2, amax, K, x2.stride(0), BLOCK=CHUNK, num_warps=4
            )
    else:
        require_dtype("scale", scale, (torch.float32,))
        if scale.numel() != 1:
            raise Fp8KernelInputError(
                f"scale has shape {tuple(scale.shape)}; a per-tensor scale has one element"
            )
        amax = out_scale = scale.reshape(1)
    return _quantize_per_tensor(x2, q, out_scale, amax, dtype, 0, x.shape, dynamic=scale is None)


def per_tensor_quant_from_row_maxima(
    x: torch.Tensor, row_max: torch.Tensor, dtype: torch.dtype = FP8_DTYPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """`per_tensor_quant_fp8` of ``x`` [M, K] whose rows' max |x| are known already (``row_max``
    [M] float32, written by a kernel that produced ``x``, such as
    `pagellm_fp8.kernels.fused_input`'s): one launch for up to ``ROW_MAXIMA_MAX_M`` rows (each
    program reduces the maxima), else two (their maximum first); the same bits."""
    require_dtype("x", x, ACTIVATION_DTYPES)
    require_dtype("row_max", row_max, (torch.float32,))
    require_fp8_format(dtype)
    x2 = rows_of("x", x)
    M = x2.shape[0]
    if tuple(row_max.shape) != (M,):
        raise Fp8KernelInputError(
            f"row_max has shape {tuple(row_max.shape)}; expected [{M}] for the {M} rows of x"
        )
    q = torch.empty(x2.shape, dtype=dtype, device=x.device)
    out_scale = torch.empty(1, dtype=torch.float32, device=x.device)
    if M == 0:
        out_scale.fill_(MIN_SCALE)
        return q.view(x.shape), out_scale
    if M > ROW_MAXIMA_MAX_M:
        amax = row_max.amax().reshape(1)
        return _quantize_per_tensor(x2, q, out_scale, amax, dtype, 0, x.shape)
    return _quantize_per_tensor(x2, q, out_scale, row_max, dtype, ROW_MAXIMA_MAX_M, x.shape)


def _quantize_per_tensor(
    x2: torch.Tensor,
    q: torch.Tensor,
    out_scale: torch.Tensor,
    amax: torch.Tensor,
    dtype: torch.dtype,
    row_maxima: int,
    shape: torch.Size,
    dynamic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantization pass of `per_tensor_quant_fp8`: ``amax`` one value, or (``row_maxima``
    > 0) one per row; a static scale is ``out_scale`` itself (``dynamic`` False)."""
    M, K = x2.shape
    if M > 0:
        _per_tensor_quant_kernel[(M, triton.cdiv(K, CHUNK))](
            x2,
            q,
            out_scale,
            amax,
            M,
            K,
            x2.stride(0),
            q.stride(0),
            **format_constants(dtype),
            MIN_SCALE=MIN_SCALE,
            BLOCK=CHUNK,
            FROM_AMAX=dynamic,
            ROW_MAXIMA=row_maxima,
            num_warps=4,
        )
    return q.view(shape), out_scale


@triton.jit
def _per_group_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    num_groups,
    stride_x,
    stride_q,
    stride_s,
    FP8_MAX: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUBNORMAL_ROUNDER: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
    HW_CAST: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (groups < num_groups)[:, None]
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = _scale_of(tl.max(tl.abs(x), axis=1), FP8_MAX, MIN_SCALE)
    q = _quantize(x, scale[:, None], FP8_MAX, MIN_NORMAL, SUBNORMAL_ROUNDER, SIGNED_ZERO, HW_CAST)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * stride_s + groups, scale, mask=groups < num_groups)


def per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int = 128, dtype: torch.dtype = FP8_DTYPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [..., K] to the float8 format ``dtype`` with one scale per row and group
    of ``group_size`` consecutive columns: ``(q [..., K], scales [..., K // group_size]
    float32)``, row-major, the activation side of ``block_scaled_mm``. ``K`` must be a multiple
    of ``group_size``, a power of two."""
    require_dtype("x", x, ACTIVATION_DTYPES)
    require_fp8_format(dtype)
    if group_size < 1 or group_size & (group_size - 1):
        raise Fp8KernelInputError(f"group_size {group_size} is not a power of two")
    x2 = rows_of("x", x)
    M, K = x2.shape
    if K % group_size:
        raise Fp8KernelInputError(
            f"x has {K} columns, not a multiple of the group size {group_size}"
        )
    num_groups = K // group_size
    q = torch.empty((M, K), dtype=dtype, device=x.device)
    scales = torch.empty((M, num_groups), dtype=torch.float32, device=x.device)
    if M > 0:
        per_program = min(triton.next_power_of_2(num_groups), max(1, CHUNK // group_size))
        _per_group_quant_kernel[(M, triton.cdiv(num_groups, per_program))](
            x2,
            q,
            scales,
            num_groups,
            x2.stride(0),
            q.stride(0),
            scales.stride(0),
            **format_constants(dtype),
            MIN_SCALE=MIN_SCALE,
            GROUP=group_size,
            GROUPS_PER_PROGRAM=per_program,
            num_warps=num_warps_for(per_program * group_size),
        )
    return q.view(x.shape), scales.view(*x.shape[:-1], num_groups)
