"""RMSNorm and residual-add + RMSNorm: one tile of whole rows per program, sums in float32.

The rounding follows the torch path of `pagellm.layers.layernorm.RMSNorm`: the residual sum is
rounded to the input dtype (as ``x + residual`` is), the normalised row is rounded to the input dtype
before it is scaled, and the scaling is one float32 product rounded once (exact for bf16/fp16
operands, so it equals torch's ``weight * normed``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from .target import gdc_launch_dependents, launches_dependents, warp_size

# A row is held in registers whole; past this a row would need a second pass over memory.
MAX_HIDDEN_SIZE = 65536
# Rows shorter than this share a program (per-head q/k norms have 128-wide rows).
_ELEMENTS_PER_PROGRAM = 2048


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    x_row_stride,
    x_head_stride,
    heads,
    residual_ptr,
    residual_row_stride,
    out_ptr,
    out_row_stride,
    weight_ptr,
    n_rows,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr = False,
):
    if LAUNCH_DEPENDENTS:  # the next kernel may start (it waits for this one's output)
        gdc_launch_dependents()
    dtype = out_ptr.dtype.element_ty
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    rows = rows.to(tl.int64)[:, None]
    # Row r of x is head r % heads of token r // heads (heads is 1 for [tokens, hidden] rows).
    x_rows = (rows // heads) * x_row_stride + (rows % heads) * x_head_stride
    x = tl.load(x_ptr + x_rows + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_ptrs = residual_ptr + rows * residual_row_stride + cols[None, :]
        residual = tl.load(residual_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
        tl.store(residual_ptrs, x, mask=mask)
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    normed = (x * rstd[:, None]).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=cols < n_cols, other=0.0).to(dtype).to(tl.float32)
    out = (normed * weight[None, :]).to(dtype)
    tl.store(out_ptr + rows * out_row_stride + cols[None, :], out, mask=mask)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, hidden] with unit column stride: a view when one exists, else a copy."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    target: GPUTarget | None,
) -> None:
    """``x`` [rows, hidden], or [tokens, heads, head_size] normalised per head; either with any
    strides but the last; ``residual`` and ``out`` [rows, hidden]."""
    if x.dim() == 3:
        heads, head_stride = x.shape[1], x.stride(1)
        n_rows, n_cols = x.shape[0] * heads, x.shape[2]
    else:
        heads, head_stride = 1, 0
        n_rows, n_cols = x.shape
    if weight.numel() != n_cols:
        raise ValueError(f"RMSNorm weight has {weight.numel()} elements; rows have {n_cols}.")
    if n_cols > MAX_HIDDEN_SIZE:
        raise ValueError(
            f"Triton RMSNorm supports rows of up to {MAX_HIDDEN_SIZE} elements, got {n_cols}; "
            "run with the torch layers (the CPU platform) for larger hidden sizes."
        )
    if n_rows == 0:
        return
    block = triton.next_power_of_2(n_cols)
    rows_per_program = max(1, _ELEMENTS_PER_PROGRAM // block)
    # About eight elements per thread: one 16-byte access per thread for bf16 rows.
    threads = warp_size(x.device, target)
    num_warps = min(16, max(1, rows_per_program * block // (8 * threads)))
    res = x if residual is None else residual
    _rms_norm_kernel[(triton.cdiv(n_rows, rows_per_program),)](
        x,
        x.stride(0),
        head_stride,
        heads,
        res,
        res.stride(0),
        out,
        out.stride(0),
        weight.contiguous(),
        n_rows,
        n_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        ROWS=rows_per_program,
        BLOCK=block,
        LAUNCH_DEPENDENTS=launches_dependents(x.device, target),
        num_warps=num_warps,
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    *,
    target: GPUTarget | None = None,
) -> torch.Tensor:
    """``weight * rms_norm(x)`` over the last dimension; rows of ``x`` may be strided, and so
    may the heads of a [tokens, heads, head_size] ``x`` (per-head norms of a fused QKV's views,
    read in place rather than copied).

    ``out`` (contiguous, ``x``'s shape and dtype) is written when given, else allocated.
    ``target``: the GPU to size the launch for, when not ``x``'s own (`warp_size`)."""
    rows = x if x.dim() == 3 and x.stride(-1) == 1 else _as_rows(x)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(
            f"rms_norm out must be contiguous {x.dtype} of shape {tuple(x.shape)}, got "
            f"{out.dtype} of shape {tuple(out.shape)} (contiguous={out.is_contiguous()})."
        )
    _launch(rows, None, out.view(-1, x.shape[-1]), weight, eps, target)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    target: GPUTarget | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``, written into ``x`` and ``residual`` in place
    (into copies of them when they cannot be viewed as rows with unit column stride); ``target``
    as in `rms_norm`."""
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(
            f"fused_add_rms_norm needs x and residual of one shape and dtype, got "
            f"{x.dtype} {tuple(x.shape)} and {residual.dtype} {tuple(residual.shape)}."
        )
    x_rows, residual_rows = _as_rows(x), _as_rows(residual)
    _launch(x_rows, residual_rows, x_rows, weight, eps, target)
    return x_rows.view(x.shape), residual_rows.view(residual.shape)
