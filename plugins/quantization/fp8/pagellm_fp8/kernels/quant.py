"""Fused FP8 activation quantization: per token (one scale per row), per tensor, and per token
group (one scale per row and group of columns, what the block-scaled GEMM takes).

Doing this with torch ops (abs, amax, div, clamp, cast) costs five passes and five launches over
the activations, about 270 us per Llama-8B layer at serving batch sizes; these kernels read each
element once (per token, per group) or twice (per tensor, whose scale needs the whole tensor).

Every kernel computes ``scale = max(amax / FP8_MAX, MIN_SCALE)`` and ``q = clamp(x / scale,
-FP8_MAX, FP8_MAX)`` in float32 with IEEE-rounded divisions (Triton's plain ``/`` on float32 is
approximate on NVIDIA GPUs), rounded to the float8 format to nearest even: bit for bit what the
same formula in torch gives (see ``reference_per_token_quant`` in the tests), on GPUs and in
Triton's interpreter. On NVIDIA GPUs float8_e4m3fn is rounded by the hardware conversion the
store does (``HW_CAST``); elsewhere by integer operations that repeat it (`_round_to_e4m3`),
which made the kernels bound by their instructions rather than by memory. The format is float8_e4m3fn (FP8_MAX 448) unless ``dtype`` asks for AMD
CDNA3's float8_e4m3fnuz (FP8_MAX 240, subnormals an exponent lower, no negative zero); Triton's
interpreter cannot store float8_e4m3fnuz, so that format's rounding is tested there on float32
outputs (test_fp8_fnuz.py) and its kernels are compiled for gfx942 (pagellm-rocm's tests).
"""

from __future__ import annotations

import os

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

# Keeps an all-zero row's scale finite and non-zero (its values quantize to 0 all the same).
MIN_SCALE = 1e-12
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


def _num_warps(block: int) -> int:
    # About 16 to 32 elements per thread.
    return max(1, min(16, block // 512))


def hardware_rounds(dtype: torch.dtype) -> bool:
    """Whether the kernels leave the rounding to ``dtype`` to the store's conversion: float8_e4m3fn
    on NVIDIA GPUs (``cvt.rn.satfinite.e4m3x2.f32``, to nearest even, as torch rounds). Not in
    Triton's interpreter (its cast rounds ties away from zero and drops the carry into the
    exponent), nor for float8_e4m3fnuz, nor on ROCm, whose conversions are not checked here."""
    return (
        dtype == FP8_DTYPE
        and os.environ.get("TRITON_INTERPRET", "0") != "1"
        and torch.version.hip is None
    )


def format_constants(
    dtype: torch.dtype, hardware_cast: bool | None = None
) -> dict[str, float | bool]:
    """The kernels' compile-time constants for the float8 format ``dtype``: its largest value,
    its smallest normal value, the float32 constant whose addition rounds to its subnormal
    spacing (1.5 times the power of two at which float32's spacing is that: e4m3 keeps 3
    mantissa bits, so the spacing is the smallest normal / 8), whether it has a -0, and whether
    the store's conversion rounds (``hardware_cast``; by default `hardware_rounds`)."""
    require_fp8_format(dtype)
    info = torch.finfo(dtype)
    return dict(
        FP8_MAX=float(info.max),
        MIN_NORMAL=float(info.smallest_normal),
        SUBNORMAL_ROUNDER=1.5 * info.smallest_normal / 8 * 2.0**23,
        SIGNED_ZERO=dtype == FP8_DTYPE,
        HW_CAST=hardware_rounds(dtype) if hardware_cast is None else hardware_cast,
    )


@triton.jit
def _round_to_e4m3(
    v, MIN_NORMAL: tl.constexpr, SUBNORMAL_ROUNDER: tl.constexpr, SIGNED_ZERO: tl.constexpr
):
    """``v`` (float32, |v| <= FP8_MAX) rounded to the nearest e4m3 value, ties to even, as
    float32.

    The cast to fp8 that follows then has nothing left to round: the result is the same on every
    Triton backend, including the interpreter, whose float32 -> fp8 cast (Triton 3.6) drops the
    carry of a rounding into the exponent (31.6 -> 16.0). On GPUs it repeats what the hardware
    cast does, a few integer operations in a kernel bound by memory.
    """
    bits = v.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = bits & 0x7FFFFFFF
    # Normal e4m3 values keep 3 of float32's 23 mantissa bits: add just under half of the 20
    # dropped bits' unit, plus the kept lowest bit (ties to even), and truncate.
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & 0xFFF00000
    # Below the smallest normal (e4m3fn: 2^-6) the spacing is an eighth of it (2^-9): float32's
    # spacing at 1.5 * 2^14, so adding and subtracting that constant rounds to it.
    a = tl.abs(v)
    subnormal = ((a + SUBNORMAL_ROUNDER) - SUBNORMAL_ROUNDER).to(tl.uint32, bitcast=True)
    rounded = tl.where(a < MIN_NORMAL, subnormal, normal)
    if not SIGNED_ZERO:  # e4m3fnuz: the bits of -0 are its NaN
        sign = tl.where(rounded == 0, 0, sign)
    return (rounded | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize(
    x,
    scale,
    FP8_MAX: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUBNORMAL_ROUNDER: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    """``x / scale`` clamped to the format's range, as float32: rounded to the format's values,
    unless ``HW_CAST`` (the store's conversion then rounds, to nearest even)."""
    q = tl.math.div_rn(x, scale)
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    if HW_CAST:
        return q
    return _round_to_e4m3(q, MIN_NORMAL, SUBNORMAL_ROUNDER, SIGNED_ZERO)


@triton.jit
def _scale_of(amax, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    return tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)


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
            num_warps=_num_warps(block),
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


def _per_tensor_quant_one_launch(
    x2: torch.Tensor, q: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
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
        num_warps=_num_warps(block),
    )
    return out_scale


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
        return q.view(x.shape), _per_tensor_quant_one_launch(x2, q, dtype)
    grid = (M, triton.cdiv(K, CHUNK))
    row_maxima = 0
    if scale is None:
        out_scale = torch.empty(1, dtype=torch.float32, device=x.device)
        if M == 0:
            amax = out_scale.fill_(MIN_SCALE)
        elif M <= ROW_MAXIMA_MAX_M and K <= ONE_PASS_MAX_K:
            row_maxima = ROW_MAXIMA_MAX_M
            amax = torch.empty(M, dtype=torch.float32, device=x.device)
            block = triton.next_power_of_2(K)
            _row_amax_kernel[(M,)](
                x2, amax, K, x2.stride(0), BLOCK=block, num_warps=_num_warps(block)
            )
        else:
            amax = torch.zeros(1, dtype=torch.float32, device=x.device)
            _amax_kernel[grid](x2, amax, K, x2.stride(0), BLOCK=CHUNK, num_warps=4)
    else:
        require_dtype("scale", scale, (torch.float32,))
        if scale.numel() != 1:
            raise Fp8KernelInputError(
                f"scale has shape {tuple(scale.shape)}; a per-tensor scale has one element"
            )
        amax = out_scale = scale.reshape(1)
    if M > 0:
        _per_tensor_quant_kernel[grid](
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
            FROM_AMAX=scale is None,
            ROW_MAXIMA=row_maxima,
            num_warps=4,
        )
    return q.view(x.shape), out_scale


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
            num_warps=_num_warps(per_program * group_size),
        )
    return q.view(x.shape), scales.view(*x.shape[:-1], num_groups)
