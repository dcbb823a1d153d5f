"""FP8 quantization fused into the layers that produce a linear layer's input: RMSNorm (with or
without the residual add) and SiLU-and-multiply, one program per token
(`pagellm_fp8.kernels.producer_kernels`), quantizing as a mode says:

- ``token``: one scale per row, ``max(amax / FP8_MAX, MIN_SCALE)``;
- ``static``: the one calibrated scale given;
- ``group``: one scale per row and group of 128 columns (the block-scaled GEMM's input);
- ``tensor``: a dynamic per-tensor scale, which needs every row first: the kernel writes the rows
  in the activation dtype and their maxima, then `quant.per_tensor_quant_from_row_maxima`
  quantizes them (two launches in all, not three; past 1,024 rows three, not four).

These are the host side: the checks, the output buffers and the launches.

Rows of at most ``MAX_COLS`` columns are held in registers whole; the entry points return None
for longer ones (the caller then runs the layers unfused). Every value quantizes as
`pagellm_fp8.kernels.rounding` says: bit for bit what quantizing the unfused layer's output gives.
"""

from __future__ import annotations

import torch
import triton

from pagellm_fp8.kernels.checks import (
    ACTIVATION_DTYPES,
    FP8_DTYPE,
    Fp8KernelInputError,
    require_dtype,
    require_fp8_format,
)
from pagellm_fp8.kernels.producer_kernels import (
    GROUP,
    ROW_MAX,
    STATIC,
    TOKEN,
    _rms_norm_quant_kernel,
    _silu_and_mul_quant_kernel,
)
from pagellm_fp8.kernels.quant import per_tensor_quant_from_row_maxima
from pagellm_fp8.kernels.rounding import MIN_SCALE, format_constants

MAX_COLS = 16384
"""The longest row (hidden size, or intermediate size for SiLU-and-multiply) fused."""

MODES = {"token": TOKEN, "static": STATIC, "group": GROUP, "tensor": ROW_MAX}
"""Each activation granularity's mode; ``tensor`` is the dynamic per-tensor scale."""
GROUP_SIZE = 128


def _num_warps(block: int) -> int:
    """About eight elements a thread (one 16-byte access for bf16), as the platform's norms."""
    return max(1, min(16, block // 256))


def fusable(mode: str, cols: int) -> bool:
    """Whether the kernels fuse ``mode``'s quantization of rows of ``cols`` outputs."""
    if cols < 1 or cols > MAX_COLS:
        return False
    return not (mode == "group" and cols % GROUP_SIZE)


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dim() != 2 or t.stride(-1) != 1:
        raise Fp8KernelInputError(
            f"{name} has shape {tuple(t.shape)} and strides {t.stride()}; expected [tokens, "
            "columns] with unit column stride"
        )
    return t


class _Outputs:
    """A launch's output buffers and the arguments that point the kernel at them."""

    def __init__(
        self,
        mode: str,
        rows: int,
        cols: int,
        x: torch.Tensor,
        fp8: torch.dtype,
        static: torch.Tensor | None,
    ) -> None:
        device = x.device
        self.mode = mode
        self.row_max: torch.Tensor | None = None
        self.scale: torch.Tensor
        if mode == "tensor":  # the row in the activation dtype, and its maximum
            self.out = torch.empty((rows, cols), dtype=x.dtype, device=device)
            self.row_max = torch.empty(rows, dtype=torch.float32, device=device)
            self.scale = self.row_max  # unused by the kernel in this mode
        else:
            self.out = torch.empty((rows, cols), dtype=fp8, device=device)
            if static is not None:  # mode "static" (`_check`)
                self.scale = static.reshape(1)
            elif mode == "group":
                self.scale = torch.empty(
                    (rows, cols // GROUP_SIZE), dtype=torch.float32, device=device
                )
            else:
                self.scale = torch.empty((rows, 1), dtype=torch.float32, device=device)
        self.fp8 = fp8

    def args(self) -> tuple[object, ...]:
        scale_stride = self.scale.stride(0) if self.scale.dim() == 2 else 0
        row_max = self.row_max if self.row_max is not None else self.scale
        return (self.out, self.out.stride(0), self.scale, scale_stride, row_max)

    def constants(self) -> dict[str, object]:
        return dict(
            **format_constants(self.fp8),
            MIN_SCALE=MIN_SCALE,
            MODE=MODES[self.mode],
            GROUP=GROUP_SIZE,
        )

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mode == "tensor":
            assert self.row_max is not None
            return per_tensor_quant_from_row_maxima(self.out, self.row_max, self.fp8)
        return self.out, self.scale


def _check(mode: str, dtype: torch.dtype, static: torch.Tensor | None) -> None:
    if mode not in MODES:
        raise Fp8KernelInputError(f"mode {mode!r} is not one of {sorted(MODES)}")
    require_fp8_format(dtype)
    if (mode == "static") != (static is not None):
        raise Fp8KernelInputError("a static scale is given with mode 'static', and only then")
    if static is not None:
        require_dtype("static_scale", static, (torch.float32,))
        if static.numel() != 1:
            raise Fp8KernelInputError(
                f"static_scale has shape {tuple(static.shape)}; a per-tensor scale has one element"
            )


def _check_norm_inputs(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None
) -> tuple[int, int]:
    require_dtype("x", x, ACTIVATION_DTYPES)
    rows, cols = _rows("x", x).shape
    if weight.numel() != cols:
        raise Fp8KernelInputError(f"weight has {weight.numel()} elements; rows have {cols}")
    if residual is not None:
        _rows("residual", residual)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise Fp8KernelInputError(
                f"residual is {residual.dtype} {tuple(residual.shape)}; x is {x.dtype} "
                f"{tuple(x.shape)}"
            )
    return rows, cols


def _launch_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    outputs: _Outputs,
) -> None:
    rows, cols = x.shape
    if rows == 0:
        return
    block = triton.next_power_of_2(cols)
    res = residual if residual is not None else x
    _rms_norm_quant_kernel[(rows,)](
        x,
        x.stride(0),
        res,
        res.stride(0),
        weight.contiguous(),
        *outputs.args(),
        cols,
        eps,
        **outputs.constants(),
        HAS_RESIDUAL=residual is not None,
        BLOCK=max(block, GROUP_SIZE),
        num_warps=_num_warps(block),
    )


def rms_norm_quant(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    mode: str,
    dtype: torch.dtype,
    residual: torch.Tensor | None = None,
    static_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``weight * rms_norm(x)`` (``x + residual`` first, written into ``residual``, when it is
    given) over ``x`` [tokens, hidden], quantized to ``dtype`` as ``mode`` says: ``(q [tokens,
    hidden], scales)``, the scales [tokens, 1] (``token``), [tokens, hidden / 128] (``group``),
    [1] (``tensor``, ``static``: ``static_scale`` itself). None when `fusable` says no."""
    _check(mode, dtype, static_scale)
    rows, cols = _check_norm_inputs(x, weight, residual)
    if not fusable(mode, cols):
        return None
    outputs = _Outputs(mode, rows, cols, x, dtype, static_scale)
    _launch_rms_norm(x, weight, eps, residual, outputs)
    return outputs.result()


def rms_norm_row_max(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first launch of `rms_norm_quant`'s ``tensor`` mode: the normed rows in ``x``'s dtype
    and each row's max |value| [tokens] float32 (rows of at most ``MAX_COLS``)."""
    rows, cols = _check_norm_inputs(x, weight, residual)
    if cols > MAX_COLS:
        raise Fp8KernelInputError(f"rows of {cols} columns; at most {MAX_COLS} are fused")
    outputs = _Outputs("tensor", rows, cols, x, FP8_DTYPE, None)
    _launch_rms_norm(x, weight, eps, residual, outputs)
    assert outputs.row_max is not None
    return outputs.out, outputs.row_max


def _check_silu_inputs(x: torch.Tensor) -> tuple[int, int]:
    require_dtype("x", x, ACTIVATION_DTYPES)
    rows, cols = _rows("x", x).shape
    if cols % 2:
        raise Fp8KernelInputError(f"x has {cols} columns; SiLU-and-multiply needs an even number")
    return rows, cols // 2


def _launch_silu_and_mul(x: torch.Tensor, d: int, outputs: _Outputs) -> None:
    if x.shape[0] == 0:
        return
    block = triton.next_power_of_2(d)
    _silu_and_mul_quant_kernel[(x.shape[0],)](
        x,
        x.stride(0),
        *outputs.args(),
        d,
        **outputs.constants(),
        BLOCK=max(block, GROUP_SIZE),
        num_warps=_num_warps(block),
    )


def silu_and_mul_quant(
    x: torch.Tensor,
    mode: str,
    dtype: torch.dtype,
    static_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``silu(x[:, :d]) * x[:, d:]`` for ``x`` [tokens, 2 * d], quantized to ``dtype`` as
    ``mode`` says (scales as in `rms_norm_quant`). None when `fusable` says no."""
    _check(mode, dtype, static_scale)
    rows, d = _check_silu_inputs(x)
    if not fusable(mode, d):
        return None
    outputs = _Outputs(mode, rows, d, x, dtype, static_scale)
    _launch_silu_and_mul(x, d, outputs)
    return outputs.result()


def silu_and_mul_row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first launch of `silu_and_mul_quant`'s ``tensor`` mode: the products in ``x``'s
    dtype [tokens, d] and each row's max |value| (``d`` at most ``MAX_COLS``)."""
    rows, d = _check_silu_inputs(x)
    if d > MAX_COLS:
        raise Fp8KernelInputError(f"rows of {d} columns; at most {MAX_COLS} are fused")
    outputs = _Outputs("tensor", rows, d, x, FP8_DTYPE, None)
    _launch_silu_and_mul(x, d, outputs)
    assert outputs.row_max is not None
    return outputs.out, outputs.row_max
