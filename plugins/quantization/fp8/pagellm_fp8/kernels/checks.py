"""Input checks shared by the FP8 kernels' entry points, with errors that say what to pass."""

from __future__ import annotations

import torch

from pagellm.quantization.fp8_formats import E4M3FN, FP8_FORMATS

FP8_DTYPE = E4M3FN
"""The default float8 format; every kernel also takes float8_e4m3fnuz (``FP8_FORMATS``)."""
# Activations the quantization kernels read: what a model runs in (and float32 for references).
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Fp8KernelInputError(ValueError):
    """A tensor given to an FP8 kernel has a dtype, shape or layout the kernel does not take."""


def require_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise Fp8KernelInputError(f"{name} has dtype {t.dtype}; expected one of {names}")


def require_fp8_format(dtype: torch.dtype) -> None:
    if dtype not in FP8_FORMATS:
        raise Fp8KernelInputError(
            f"dtype {dtype} is not a float8 format the kernels write (float8_e4m3fn or "
            "float8_e4m3fnuz)"
        )


def require_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise Fp8KernelInputError(f"{name} has shape {tuple(t.shape)}; expected {shape}")


def rows_of(name: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D [rows, K] view with unit stride along K (copied only when it has none)."""
    if x.dim() < 1 or x.shape[-1] == 0:
        raise Fp8KernelInputError(
            f"{name} has shape {tuple(x.shape)}; expected [..., K] with K > 0"
        )
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()
