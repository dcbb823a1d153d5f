"""The FP8 GEMM of one linear layer, chosen once per layer (`choose_gemm`) from the scheme and
the device, and the reason a scheme cannot run on a device (`gemm_refusal`).

Paths, all computing ``out = dequant(quant(x)) @ dequant(weight).T``:
- ``reference``: CPU (and CI): dequantize both operands, float32 matmul.
- ``scaled_mm_tensor``: ``torch._scaled_mm`` with per-tensor scales (capability >= 8.9).
- ``scaled_mm_rowwise``: ``torch._scaled_mm`` with row-wise scales, activations [M, 1] and
  weights [1, N] (capability >= 9.0); on 8.9 the same product with unit scales in float32 and the
  scales applied after (``scaled_mm_rowwise_epilogue``).
- ``block_scaled_mm``: the Triton 128x128 block-scaled GEMM of ``pagellm_fp8.kernels``.
Activation quantization on CUDA (per token, per tensor, per group of 128 for the block GEMM) uses
the fused Triton kernels of ``pagellm_fp8.kernels`` when they import, else torch ops (`quant_ops`).
Every path computes in the scheme's float8 format (`Fp8Scheme.fp8_dtype`, the platform's):
float8_e4m3fn, or float8_e4m3fnuz on AMD CDNA3 (ROCm's ``torch._scaled_mm`` and Triton take it;
neither has been run on AMD hardware).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import ModuleType

import torch

from pagellm.quantization.fp8_formats import FP8_FORMATS
from pagellm_fp8.quant_ops import (
    FP8_DTYPE,
    dequantize_activation,
    dequantize_weight,
    quantize_activation,
)
from pagellm_fp8.scheme import Fp8Scheme, WeightGranularity

SCALED_MM_MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada, Hopper and newer
ROWWISE_MIN_CAPABILITY = (9, 0)  # row-wise scales in torch._scaled_mm: Hopper and newer

QuantizeFn = Callable[[torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, torch.Tensor]]
"""(x [M, K] float, static input scale or None) -> (x quantized [M, K], its scales)."""
MatmulFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor
]
"""(x quantized [M, K], its scales, weight float8 [N, K], weight scales, out dtype) -> [M, N]."""


@dataclass(frozen=True)
class Fp8Gemm:
    """A layer's GEMM in its two steps: quantize the input (`quantize`, skipped when the layer
    producing the input has quantized it already: `pagellm_fp8.input_quant`), then multiply
    (`matmul`). Called as ``gemm(x, weight, weight_scale, input_scale)`` it does both."""

    quantize: QuantizeFn
    matmul: MatmulFn

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor,
        input_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        q, x_scale = self.quantize(x, input_scale)
        return self.matmul(q, x_scale, weight, scale, x.dtype)


GemmFn = Fp8Gemm


def triton_kernels(name: str) -> ModuleType | str:
    """``pagellm_fp8.kernels.<name>``, or why it does not import (no Triton, no such module)."""
    try:
        return importlib.import_module(f"pagellm_fp8.kernels.{name}")
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"


def gemm_refusal(
    weights: WeightGranularity,
    device_type: str,
    dtype: torch.dtype,
    capability: tuple[int, int] | None = None,
    platform_fp8: torch.dtype | None = FP8_DTYPE,
) -> str | None:
    """Why a scheme with ``weights`` scales cannot run on ``device_type`` (``capability``: the
    GPU's, asked of the current GPU when None; ``platform_fp8``: the fp8 format the platform
    computes in, `Platform.fp8_dtype`), or None."""
    if device_type == "cpu":
        return None  # the reference path runs every scheme
    if device_type != "cuda":
        return (
            f"pagellm-fp8 has no fp8 GEMM for device type {device_type!r} "
            "(it runs on CUDA GPUs of compute capability 8.9 or newer, and on the CPU)"
        )
    if platform_fp8 is None:
        return "this GPU has no fp8 matrix instructions; serve the unquantized model instead"
    if platform_fp8 not in FP8_FORMATS:
        return (
            f"this GPU computes fp8 in {str(platform_fp8).removeprefix('torch.')}, and "
            "pagellm-fp8 computes in float8_e4m3fn or float8_e4m3fnuz only; serve the "
            "unquantized model instead"
        )
    capability = capability or torch.cuda.get_device_capability()
    if capability < SCALED_MM_MIN_CAPABILITY:
        return (
            f"fp8 GEMMs need fp8 tensor cores (compute capability 8.9 or newer: Ada, Hopper); this "
            f"GPU is {capability[0]}.{capability[1]}; serve the unquantized model instead"
        )
    if dtype not in (torch.bfloat16, torch.float16):
        return f"fp8 GEMMs on CUDA write bfloat16 or float16, not {dtype}; pass --dtype bfloat16"
    if weights == "block":
        block_gemm = triton_kernels("block_gemm")
        if isinstance(block_gemm, str):
            return (
                "128x128 block-scaled fp8 weights need the Triton block-scaled GEMM "
                f"(pagellm_fp8.kernels.block_gemm), which does not import ({block_gemm}); "
                "install pagellm-fp8[triton]"
            )
    return None


def reference_gemm(scheme: Fp8Scheme) -> GemmFn:
    def quantize(
        x: torch.Tensor, input_scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_activation(x, scheme.activations, input_scale, scheme.fp8_dtype)

    def matmul(
        q: torch.Tensor,
        x_scale: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        a = dequantize_activation(q, x_scale, scheme.activations)
        return (a @ dequantize_weight(weight, scale, scheme.weights).t()).to(out_dtype)

    return Fp8Gemm(quantize, matmul)


def _resolve_per_tensor_quant(
    dtype: torch.dtype,
) -> Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]:
    quant = triton_kernels("quant")
    if isinstance(quant, ModuleType):
        return partial(
            quant.per_tensor_quant_fp8, dtype=dtype, one_launch=quant.one_launch_enabled()
        )
    return lambda x, input_scale: quantize_activation(x, "tensor", input_scale, dtype)


SKINNY_ENV = "PAGELLM_FP8_SKINNY_GEMM"
"""``1``: batches of up to 256 tokens go through `pagellm_fp8.kernels.skinny_gemm` instead of
``torch._scaled_mm`` (per-tensor float8_e4m3fn only). An experiment for the benchmarks, off by
default until the H200 measures it faster end to end."""


def env_switch(name: str) -> bool:
    """An on-by-default switch: unset or ``1`` on, ``0`` off; anything else is refused."""
    value = os.environ.get(name, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: set it to 1 (the default) or 0.")
    return value == "1"


FAST_ACCUM_ENV = "PAGELLM_FP8_FAST_ACCUM"
"""On by default (``0`` turns it off): per-tensor and row-wise layers call ``torch._scaled_mm``
with ``use_fast_accum=True`` (the FP8 MMAs accumulate without the periodic promotion to
float32, as vLLM's CUTLASS FP8 kernels for Hopper do). Measured on an H100 (docs/benchmarks.md,
2026-12-07): W1 3 % faster with fp8 weights; the tests' tolerances and greedy agreement hold."""


def _fast_accum() -> bool:
    return env_switch(FAST_ACCUM_ENV)


def _skinny_gemm() -> ModuleType | None:
    if os.environ.get(SKINNY_ENV) != "1":
        return None
    module = triton_kernels("skinny_gemm")
    return None if isinstance(module, str) else module


def _scaled_mm_tensor(scheme: Fp8Scheme) -> GemmFn:
    skinny = _skinny_gemm() if scheme.fp8_dtype == torch.float8_e4m3fn else None
    fast_accum = _fast_accum()

    def matmul(
        q: torch.Tensor,
        x_scale: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        if skinny is not None and q.shape[0] <= skinny.MAX_M:
            return skinny.skinny_gemm(q, weight, x_scale, scale.reshape(1), out_dtype=out_dtype)
        # weight [N, K] row-major: its transpose is the column-major [K, N] operand _scaled_mm wants.
        return torch._scaled_mm(
            q,
            weight.t(),
            scale_a=x_scale,
            scale_b=scale,
            out_dtype=out_dtype,
            use_fast_accum=fast_accum,
        )

    return Fp8Gemm(_resolve_per_tensor_quant(scheme.fp8_dtype), matmul)


def _scaled_mm_rowwise(scheme: Fp8Scheme, native: bool) -> GemmFn:
    per_token = _resolve_per_token_quant(scheme.fp8_dtype)
    fast_accum = _fast_accum()

    def quantize(
        x: torch.Tensor, input_scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return per_token(x)

    def matmul(
        q: torch.Tensor,
        x_scale: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        w_scale = scale.reshape(1, -1)  # [N, 1] -> [1, N], contiguous
        if native:
            # Row-wise scaling writes bfloat16 only.
            out = torch._scaled_mm(
                q,
                weight.t(),
                scale_a=x_scale,
                scale_b=w_scale,
                out_dtype=torch.bfloat16,
                use_fast_accum=fast_accum,
            )
            return out.to(out_dtype)
        one = torch.ones(1, dtype=torch.float32, device=q.device)
        out = torch._scaled_mm(
            q,
            weight.t(),
            scale_a=one,
            scale_b=one,
            out_dtype=torch.float32,
            use_fast_accum=fast_accum,
        )
        return (out * x_scale * w_scale).to(out_dtype)

    return Fp8Gemm(quantize, matmul)


def _resolve_per_token_quant(
    dtype: torch.dtype,
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    quant = triton_kernels("quant")
    if isinstance(quant, ModuleType):
        return partial(quant.per_token_quant_fp8, dtype=dtype)
    return lambda x: quantize_activation(x, "token", dtype=dtype)


def _block_scaled_mm(scheme: Fp8Scheme, block_gemm: ModuleType) -> GemmFn:
    def quantize(
        x: torch.Tensor, input_scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The fused per-group (128 columns) quantization kernel of the same module.
        return block_gemm.per_token_group_quant_fp8(x, 128, dtype=scheme.fp8_dtype)

    def matmul(
        q: torch.Tensor,
        x_scale: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        return block_gemm.block_scaled_mm(q, x_scale, weight, scale, out_dtype)

    return Fp8Gemm(quantize, matmul)


SCALED_MM_MULTIPLE = 16
"""``torch._scaled_mm`` takes matrices whose both dimensions are multiples of 16."""


def shape_refusal(
    scheme: Fp8Scheme, device: torch.device, out_features: int, in_features: int
) -> str | None:
    """Why a layer of this shape cannot run the GEMM `choose_gemm` would give it on ``device``,
    or None (the reference path and the block GEMM take any shape their scales allow)."""
    if device.type != "cuda" or scheme.weights == "block":
        return None
    bad = [
        f"{name} {size}"
        for name, size in (("out_features", out_features), ("in_features", in_features))
        if size % SCALED_MM_MULTIPLE
    ]
    if not bad:
        return None
    return (
        f"torch._scaled_mm needs both weight dimensions to be multiples of "
        f"{SCALED_MM_MULTIPLE}; this layer has {', '.join(bad)}"
    )


def choose_gemm(scheme: Fp8Scheme, device: torch.device) -> tuple[str, GemmFn]:
    """The path's name and its function for a layer of ``scheme`` whose weights are on ``device``
    (`gemm_refusal` has already said the device can run it)."""
    if device.type != "cuda":
        return "reference", reference_gemm(scheme)
    capability = torch.cuda.get_device_capability(device)
    if scheme.weights == "tensor":
        return "scaled_mm_tensor", _scaled_mm_tensor(scheme)
    if scheme.weights == "channel":
        native = capability >= ROWWISE_MIN_CAPABILITY
        name = "scaled_mm_rowwise" if native else "scaled_mm_rowwise_epilogue"
        return name, _scaled_mm_rowwise(scheme, native)
    block_gemm = triton_kernels("block_gemm")
    if isinstance(block_gemm, str):
        raise RuntimeError(f"fp8 block-scaled weights on CUDA need {block_gemm}")
    return "block_scaled_mm", _block_scaled_mm(scheme, block_gemm)
