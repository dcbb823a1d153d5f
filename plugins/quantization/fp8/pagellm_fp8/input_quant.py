"""The fp8 layers' input quantization, fused into the layers that produce their inputs
(`pagellm.quantization.InputQuantizer`): the norms before qkv_proj and gate_up_proj and the
SiLU-and-multiply before down_proj write float8 and its scales directly, one kernel each
(`pagellm_fp8.kernels.fused_input`), instead of a bf16 activation that the linear layer then
quantizes in one or two more launches. Per token: three launches fewer a Llama layer; per
tensor (dynamic): three fewer too, the norm's kernel finding each row's maximum.

On by default; ``PAGELLM_FP8_FUSED_INPUT_QUANT=0`` turns it off. Measured end to end on an H100
(docs/benchmarks.md, 2026-12-07): the same greedy tokens as unfused on W1, 1 % faster. On the
CPU (the reference GEMM) the same contract is kept by torch: the producer's torch formula, then
the layer's own quantization, the same bits as unfused (what the CPU tests check end to end).
"""

from __future__ import annotations

from types import ModuleType

import torch

from pagellm.layers.activation import silu_and_mul_torch
from pagellm.layers.layernorm import rms_norm_torch
from pagellm.quantization import InputQuantizer, QuantizedActivation
from pagellm_fp8.gemm import Fp8Gemm, env_switch, triton_kernels
from pagellm_fp8.scheme import Fp8Scheme

FUSED_INPUT_QUANT_ENV = "PAGELLM_FP8_FUSED_INPUT_QUANT"


def fused_input_quant_enabled() -> bool:
    return env_switch(FUSED_INPUT_QUANT_ENV)


KERNEL_MODES = {
    "scaled_mm_tensor": "tensor",
    "scaled_mm_rowwise": "token",
    "scaled_mm_rowwise_epilogue": "token",
    "block_scaled_mm": "group",
}
"""The fused kernels' mode (`fused_input.MODES`) that quantizes as each GEMM path's own
`Fp8Gemm.quantize` does: per tensor (``static`` with a calibrated scale), per token, per group."""


def kernel_mode(gemm_path: str, input_scale: torch.Tensor | None) -> str | None:
    mode = KERNEL_MODES.get(gemm_path)
    if mode == "tensor" and input_scale is not None:
        return "static"
    return mode


class TorchInputQuantizer(InputQuantizer):
    """The producer in torch, then the layer's quantization (the reference path's contract)."""

    def __init__(self, gemm: Fp8Gemm, input_scale: torch.Tensor | None) -> None:
        self.gemm = gemm
        self.input_scale = input_scale

    def _quantized(self, y: torch.Tensor) -> QuantizedActivation:
        q, scale = self.gemm.quantize(y, self.input_scale)
        return QuantizedActivation(q, scale, y.dtype)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> QuantizedActivation | None:
        return self._quantized(rms_norm_torch(x, weight, eps))

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[QuantizedActivation, torch.Tensor] | None:
        residual = x + residual
        return self._quantized(rms_norm_torch(residual, weight, eps)), residual

    def silu_and_mul(self, x: torch.Tensor) -> QuantizedActivation | None:
        return self._quantized(silu_and_mul_torch(x))


def _quantized(
    result: tuple[torch.Tensor, torch.Tensor] | None, dtype: torch.dtype
) -> QuantizedActivation | None:
    if result is None:
        return None
    q, scale = result
    return QuantizedActivation(q, scale, dtype)


def _rows(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these as they are: [tokens, columns], unit column stride."""
    return all(t.dim() == 2 and t.stride(-1) == 1 for t in tensors)


class TritonInputQuantizer(InputQuantizer):
    """The fused kernels; None (unfused) for shapes they do not take (`fused_input.fusable`)."""

    def __init__(
        self,
        kernels: ModuleType,
        mode: str,
        fp8_dtype: torch.dtype,
        input_scale: torch.Tensor | None,
    ) -> None:
        self.kernels = kernels
        self.mode = mode
        self.fp8_dtype = fp8_dtype
        self.input_scale = input_scale if mode == "static" else None

    def _norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
    ) -> QuantizedActivation | None:
        result = self.kernels.rms_norm_quant(
            x, weight, eps, self.mode, self.fp8_dtype, residual, self.input_scale
        )
        return _quantized(result, x.dtype)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> QuantizedActivation | None:
        return self._norm(x, weight, eps, None) if _rows(x) else None

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[QuantizedActivation, torch.Tensor] | None:
        if not _rows(x, residual):
            return None
        quantized = self._norm(x, weight, eps, residual)  # residual += x, in place
        return None if quantized is None else (quantized, residual)

    def silu_and_mul(self, x: torch.Tensor) -> QuantizedActivation | None:
        if not _rows(x):
            return None
        result = self.kernels.silu_and_mul_quant(x, self.mode, self.fp8_dtype, self.input_scale)
        return _quantized(result, x.dtype)


def make_input_quantizer(
    scheme: Fp8Scheme, gemm: Fp8Gemm, gemm_path: str, input_scale: torch.Tensor | None
) -> InputQuantizer | None:
    """The input quantizer of a layer whose GEMM is ``gemm`` (path ``gemm_path``), or None when
    fusing is off or the GPU kernels do not import."""
    if not fused_input_quant_enabled():
        return None
    if gemm_path == "reference":
        return TorchInputQuantizer(gemm, input_scale)
    mode = kernel_mode(gemm_path, input_scale)
    kernels = triton_kernels("fused_input")
    if mode is None or isinstance(kernels, str):
        return None
    return TritonInputQuantizer(kernels, mode, scheme.fp8_dtype, input_scale)
