"""The int4 GEMM of one linear layer, chosen by device (and shape) once per layer, with the
layout its kernels read, and by M (tokens) per call; and the reason a device cannot run one
(`gemm_refusal`).

Paths, all computing ``out = x[:, perm] @ dequantize(weight)``:
- ``reference`` (CPU, any device without CUDA): `kernel_layout`; dequantize to the activation
  dtype (float32 math, one rounding), then the dense matmul: exact against the same dequantized
  dense weights.
- ``cuda_mma`` (CUDA GPUs of compute capability 8.0 and up with nvcc on the machine, layers
  whose K is a multiple of 16): `fragment_layout`, the CUDA kernels of ``cuda/w4a16_mma.cu``.
  ``M <= CUDA_FUSED_MAX_M``: the tensor-core W4A16 GEMM (16 rows a launch: a decode step is bound
  by reading weights, a quarter of bf16's bytes); above, the weight dequantized to the
  activation dtype (transposed) and cuBLAS: prefill is bound by the tensor cores, where cuBLAS
  wins, and dequantizing costs one pass over the weight (amortized over M rows).
- ``triton_w4a16`` (other CUDA GPUs, or ``PAGELLM_INT4_KERNELS=triton``): `kernel_layout`, the
  Triton kernels (`pagellm_int4.kernels.w4a16`): fused W4A16 GEMM at ``M <= FUSED_MAX_M``,
  dequantization + cuBLAS above.

``PAGELLM_INT4_KERNELS`` (``auto``, ``cuda`` or ``triton``) picks between the two CUDA paths:
``auto`` takes ``cuda_mma`` where it runs and logs why not where it does not; ``cuda`` makes
its absence an error.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from pagellm_int4.fragment_layout import (
    FragmentLayout,
    fragment_layout_problem,
    to_fragment_layout,
)
from pagellm_int4.int4_values import Int4Values
from pagellm_int4.kernel_layout import KernelLayout, dequantize, to_kernel_layout

logger = logging.getLogger(__name__)

FUSED_MAX_M = 64
"""The largest M (tokens in the call) the fused Triton W4A16 GEMM serves; above it, dequantize +
cuBLAS. A first guess at the crossover on an H200 (benchmarks/int4_gemm.py measures both)."""
CUDA_FUSED_MAX_M = 64
"""The same for the CUDA GEMM, which reads the weights once per 16 rows."""
KERNELS_ENV = "PAGELLM_INT4_KERNELS"

Layout = Any  # KernelLayout or FragmentLayout
GemmFn = Callable[[torch.Tensor, Layout], torch.Tensor]


@dataclass(frozen=True)
class Int4Gemm:
    name: str
    make_layout: Callable[[Int4Values, int, str], Layout]
    run: GemmFn


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
            "(it runs on CUDA GPUs through its CUDA or Triton kernels, and on the CPU)"
        )
    if dtype not in (torch.bfloat16, torch.float16):
        return f"int4 GEMMs on CUDA write bfloat16 or float16, not {dtype}; pass --dtype bfloat16"
    kernels = triton_kernels()
    if isinstance(kernels, str) and not _cuda_kernels_may_build():
        return (
            "int4 weights on CUDA need pagellm-int4's CUDA kernels (compiled by nvcc, which "
            f"is not installed) or its Triton kernels, which do not import ({kernels}); "
            "install pagellm-int4[triton]"
        )
    return None


def _cuda_kernels_may_build() -> bool:
    """nvcc is there and not turned off (checked without compiling: this runs in the front end)."""
    from pagellm_int4.cuda.build import find_nvcc

    return os.environ.get(KERNELS_ENV, "auto") != "triton" and find_nvcc() is not None


def _activations(x: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    return x if perm is None else x.index_select(1, perm)


def reference_gemm(x: torch.Tensor, layout: KernelLayout) -> torch.Tensor:
    # [N, K] contiguous, as a dense layer's weight: the same matmul as the dense model's.
    weight = dequantize(layout, x.dtype).t().contiguous()
    return F.linear(_activations(x, layout.perm), weight)


def _triton_gemm(kernels: ModuleType) -> GemmFn:
    def gemm(x: torch.Tensor, layout: KernelLayout) -> torch.Tensor:
        a = _activations(x, layout.perm)
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


def _cuda_gemm(kernels: Any) -> GemmFn:
    def gemm(x: torch.Tensor, layout: FragmentLayout) -> torch.Tensor:
        a = _activations(x, layout.perm)
        if a.shape[0] <= CUDA_FUSED_MAX_M:
            return kernels.gemm(a, layout)
        return F.linear(a, kernels.dequantize_t(layout, x.dtype))

    return gemm


def _cuda_layout(kernels: Any) -> Callable[[Int4Values, int, str], FragmentLayout]:
    def make(values: Int4Values, group_size: int, name: str) -> FragmentLayout:
        layout = to_fragment_layout(values, group_size, name)
        kernels.reserve_counters(layout.n64)  # before any graph is captured
        if kernels.overlap:
            # A GEMM launched with programmatic dependent launch reads its weights before it
            # waits for the kernel before it: the layout's writes must be done by then.
            torch.cuda.synchronize(layout.words.device)
        return layout

    return make


@functools.cache
def cuda_kernels_or_reason(device: torch.device) -> Any:
    """`pagellm_int4.cuda.kernels.CudaKernels` on ``device`` (compiled on first use, then from
    the cache), or why they cannot run there."""
    choice = os.environ.get(KERNELS_ENV, "auto")
    if choice not in ("auto", "cuda", "triton"):
        raise ValueError(f"{KERNELS_ENV}={choice!r}: expected auto, cuda or triton")
    if choice == "triton":
        return f"{KERNELS_ENV}=triton"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if major < 8:
        return f"compute capability {major}.{minor} (the MMA needs 8.0 or later)"
    from pagellm_int4.cuda.build import BuildError
    from pagellm_int4.cuda.driver import DriverError
    from pagellm_int4.cuda.kernels import for_device

    try:
        return for_device(torch.device("cuda", index))
    except (BuildError, DriverError, OSError) as exc:
        if choice == "cuda":
            raise
        return str(exc)


@functools.cache
def _log_triton_reason(reason: str) -> None:
    logger.info("pagellm-int4: the Triton kernels run int4 layers here: %s", reason)


def choose_gemm(device: torch.device, in_features: int = 0, group_size: int = 0) -> Int4Gemm:
    """The path for a layer whose weights are on ``device``, with ``in_features`` inputs in
    groups of ``group_size`` (the CUDA kernels need both multiples of 16)."""
    if device.type != "cuda":
        return Int4Gemm("reference", to_kernel_layout, reference_gemm)
    cuda = cuda_kernels_or_reason(device)
    problem = cuda if isinstance(cuda, str) else fragment_layout_problem(in_features, group_size)
    if problem is None:
        return Int4Gemm("cuda_mma", _cuda_layout(cuda), _cuda_gemm(cuda))
    if os.environ.get(KERNELS_ENV) == "cuda":
        raise RuntimeError(f"{KERNELS_ENV}=cuda, but the CUDA int4 kernels cannot run: {problem}")
    _log_triton_reason(problem)
    kernels = triton_kernels()
    if isinstance(kernels, str):
        raise RuntimeError(
            f"int4 weights on CUDA need the CUDA kernels ({problem}) or the Triton kernels "
            f"({kernels})"
        )
    return Int4Gemm("triton_w4a16", to_kernel_layout, _triton_gemm(kernels))
