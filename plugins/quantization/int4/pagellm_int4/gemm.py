"""The int4 GEMM of one linear layer, from the kernel layout (`kernel_layout`), chosen by device
once per layer and by M (tokens) per call, and the reason a device cannot run it (`gemm_refusal`).

Paths, all computing ``out = x[:, perm] @ dequantize(weight)``:
- ``reference`` (CPU, any device without CUDA): dequantize to the activation dtype (float32
  math, one rounding), then the dense matmul: exact against the same dequantized dense weights.
- on CUDA, ``M <= FUSED_MAX_M``: `pagellm_int4.kernels.w4a16.w4a16_gemm`, the fused Triton
  W4A16 GEMM (a decode step is bound by reading weights; it reads a quarter of bf16's bytes);
- on CUDA, ``M > FUSED_MAX_M``: the Triton dequantization of the whole weight to the activation
  dtype, then cuBLAS (``torch.mm``): prefill is bound by the tensor cores, where cuBLAS wins, and
  dequantizing costs one pass over the weight (amortized over M rows).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from pagellm_int4.kernel_layout import KernelLayout, dequantize

FUSED_MAX_M = 64
"""The largest M (tokens in the call) the fused W4A16 GEMM serves; above it, dequantize + cuBLAS.
A first guess at the crossover on an H200 (benchmarks/int4_gemm.py measures both paths per M)."""

GemmFn = Callable[[torch.Tensor, KernelLayout], torch.Tensor]


def triton_kernels() -> ModuleType | str:
    """``pagellm_int4.kernels.w4a16``, or why it does not import (no Triton)."""
    try:
        return importlib.import_module("pagellm_int4.kernels.w4a16")
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"


def gemm_refusal(device_type: str, dtype: torch.dtype) -> str | None:
    if device_type == "cpu":
        return None  # the reference path runs every format and dtype
    if device_type != "cuda":
        return (
            f"pagellm-int4 has no int4 GEMM for device type {device_type!r} "
            "(it runs on CUDA GPUs through Triton, and on the CPU)"
        )
    if dtype not in (torch.bfloat16, torch.float16):
        return f"int4 GEMMs on CUDA write bfloat16 or float16, not {dtype}; pass --dtype bfloat16"
    kernels = triton_kernels()
    if isinstance(kernels, str):
        return (
            "int4 weights on CUDA need the Triton W4A16 kernels (pagellm_int4.kernels.w4a16), "
            f"which do not import ({kernels}); install pagellm-int4[triton]"
        )
    return None


def _activations(x: torch.Tensor, layout: KernelLayout) -> torch.Tensor:
    return x if layout.perm is None else x.index_select(1, layout.perm)


def reference_gemm(x: torch.Tensor, layout: KernelLayout) -> torch.Tensor:
    # [N, K] contiguous, as a dense layer's weight: the same matmul as the dense model's.
    weight = dequantize(layout, x.dtype).t().contiguous()
    return F.linear(_activations(x, layout), weight)


def _cuda_gemm(kernels: ModuleType) -> GemmFn:
    def gemm(x: torch.Tensor, layout: KernelLayout) -> torch.Tensor:
        a = _activations(x, layout)
        if a.shape[0] <= FUSED_MAX_M:
            return kernels.w4a16_gemm(
                a.contiguous(), layout.qweight, layout.scales, layout.zeros, layout.group_size
            )
        weight = kernels.dequantize_int4(
            layout.qweight,
            layout.scales,
            layout.zeros,
            layout.group_size,
            layout.in_features,
            x.dtype,
        )
        return torch.mm(a, weight)

    return gemm


def choose_gemm(device: torch.device) -> tuple[str, GemmFn]:
    """The path's name and function for a layer whose weights are on ``device``."""
    if device.type != "cuda":
        return "reference", reference_gemm
    kernels = triton_kernels()
    if isinstance(kernels, str):
        raise RuntimeError(f"int4 weights on CUDA need the Triton kernels: {kernels}")
    return "triton_w4a16", _cuda_gemm(kernels)
