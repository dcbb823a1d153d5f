"""Torch references of pagellm-fp8's kernels (the formulas the kernels must reproduce), and how
the kernel tests import the package, shared by test_fp8_kernels.py (CPU, interpreter) and
test_fp8_kernels_gpu.py (compiled, CUDA)."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

PLUGIN_DIR = Path(__file__).resolve().parents[1]
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12


def forget_kernels() -> None:
    """Drop pagellm_fp8's kernel modules, so the next import decorates them afresh (Triton
    reads TRITON_INTERPRET when a kernel is decorated)."""
    for name in [m for m in sys.modules if m.startswith("pagellm_fp8.kernels")]:
        del sys.modules[name]


@contextlib.contextmanager
def fresh_kernel_module(name: str, interpret: bool) -> Iterator[ModuleType]:
    """``pagellm_fp8.kernels.<name>`` imported afresh from the source tree, interpreted by
    Triton (``interpret``, with the GPU's bfloat16 rounding) or compiled; forgotten after."""
    with contextlib.ExitStack() as stack:
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        if interpret:
            from pagellm.testing.triton_interpreter import gpu_bfloat16_rounding

            mp.setenv("TRITON_INTERPRET", "1")
            stack.enter_context(gpu_bfloat16_rounding())
        mp.syspath_prepend(str(PLUGIN_DIR))
        forget_kernels()
        stack.callback(forget_kernels)
        yield importlib.import_module(f"pagellm_fp8.kernels.{name}")


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    # A tensor divisor: on CUDA, torch divides by a Python number as a multiplication by its
    # reciprocal, not as the IEEE division the kernels do.
    return (amax / amax.new_full((), FP8_MAX)).clamp(min=MIN_SCALE)


def reference_per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = scale_of(x.float().abs().amax(-1, keepdim=True))
    return quantize(x, scale), scale


def reference_per_tensor_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = scale_of(x.float().abs().amax()).reshape(1)
    return quantize(x, scale), scale


def reference_per_group_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    groups = x.float().unflatten(-1, (-1, group))
    scale = scale_of(groups.abs().amax(-1))
    return quantize(groups, scale[..., None]).flatten(-2), scale


def reference_mode_quant(
    y: torch.Tensor, mode: str, static_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``y`` quantized as `pagellm_fp8.kernels.fused_input`'s ``mode`` does (``static``: with
    ``static_scale``)."""
    if mode == "token":
        return reference_per_token_quant(y)
    if mode == "group":
        return reference_per_group_quant(y, 128)
    if mode == "tensor":
        return reference_per_tensor_quant(y)
    return quantize(y, static_scale), static_scale


def reference_block_quant_weight(
    w: torch.Tensor, block: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] quantized per block x block tile (the last row block may be short), as
    128x128-block FP8 checkpoints store it: (q [N, K], scales [ceil(N / block), K // block])."""
    n, k = w.shape
    rows = -(-n // block) * block
    padded = torch.zeros(rows, k, dtype=torch.float32, device=w.device)
    padded[:n] = w.float()
    tiles = padded.view(rows // block, block, k // block, block)
    scale = scale_of(tiles.abs().amax(dim=(1, 3)))
    q = quantize(tiles, scale[:, None, :, None]).view(rows, k)[:n]
    return q, scale


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``q.float()`` times each element's scale, ``scales`` given per ``rows`` x ``cols`` tile."""
    full = scales.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    return q.double() * full[: q.shape[0], : q.shape[1]].double()


def reference_block_scaled_mm(
    a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor
) -> torch.Tensor:
    """The block-scaled product in float64 over the dequantized operands."""
    return dequantize_blocks(a, a_scales, 1, 128) @ dequantize_blocks(b, b_scales, 128, 128).T


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
