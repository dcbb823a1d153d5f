"""The checks an int4 kernel makes of its inputs before a launch."""

from __future__ import annotations

import torch
import triton

from pagellm_int4.kernel_layout import TILE_K


class Int4KernelInputError(ValueError):
    """A tensor given to an int4 kernel has a dtype or shape the kernel does not take."""


def check_weight(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int, group_size: int
) -> int:
    n = qweight.shape[1]
    word_rows = triton.cdiv(k, TILE_K) * (TILE_K // 8)
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != (word_rows, n):
        raise Int4KernelInputError(
            f"qweight has dtype {qweight.dtype} and shape {tuple(qweight.shape)}; expected "
            f"int32 [{word_rows}, {n}] (tile-interleaved) for K = {k}"
        )
    groups = triton.cdiv(k, group_size)
    if scales.dtype != torch.float32 or tuple(scales.shape) != (groups, n):
        raise Int4KernelInputError(
            f"scales has dtype {scales.dtype} and shape {tuple(scales.shape)}; expected "
            f"float32 [{groups}, {n}]"
        )
    if zeros.dtype != torch.uint8 or tuple(zeros.shape) != (groups, n):
        raise Int4KernelInputError(
            f"zeros has dtype {zeros.dtype} and shape {tuple(zeros.shape)}; expected "
            f"uint8 [{groups}, {n}]"
        )
    if not (qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()):
        raise Int4KernelInputError("qweight, scales and zeros must be contiguous")
    return n
