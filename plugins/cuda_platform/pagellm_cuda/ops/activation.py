"""SiLU-and-multiply of the fused gate_up projection: ``silu(x[:, :d]) * x[:, d:]``.

Float32 arithmetic with torch's two roundings: ``silu(gate)`` is rounded to the input dtype before
the product (torch's ``F.silu(gate) * up`` is two ops), so results match the torch path of
`pagellm.layers.activation.SiluAndMul` up to the last ulp of ``exp``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from .target import gdc_launch_dependents, launches_dependents, warp_size

# Columns per program: one 16-byte access per thread for bf16 with four warps of 32 threads.
_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    x_row_stride,
    out_ptr,
    out_row_stride,
    d,
    BLOCK: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr = False,
):
    if LAUNCH_DEPENDENTS:  # the next kernel may start (it waits for this one's output)
        gdc_launch_dependents()
    dtype = out_ptr.dtype.element_ty
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x_row = x_ptr + token * x_row_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * out_row_stride + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(
    x: torch.Tensor, out: torch.Tensor | None = None, *, target: GPUTarget | None = None
) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` [..., 2 * d] (rows may be strided).

    ``out`` (contiguous, [..., d], ``x``'s dtype) is written when given, else allocated.
    ``target``: the GPU to size the launch for, when not ``x``'s own (`warp_size`)."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension, got {tuple(x.shape)}.")
    d = x.shape[-1] // 2
    out_shape = (*x.shape[:-1], d)
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != out_shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(
            f"silu_and_mul out must be contiguous {x.dtype} of shape {out_shape}, got "
            f"{out.dtype} of shape {tuple(out.shape)} (contiguous={out.is_contiguous()})."
        )
    rows = x.reshape(-1, 2 * d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.shape[0] == 0 or d == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](
        rows,
        rows.stride(0),
        out,
        d,  # out is contiguous: its rows are d apart
        d,
        BLOCK=block,
        LAUNCH_DEPENDENTS=launches_dependents(x.device, target),
        num_warps=max(1, block // (8 * warp_size(x.device, target))),
    )
    return out
