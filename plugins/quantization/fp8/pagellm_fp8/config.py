"""The four registered methods. Each quantizes bf16/fp16/fp32 checkpoints at load (its online
scheme), and reads the fp8 checkpoints whose weight scales match its name:

| method | online: weight scales, activation scales | reads |
|---|---|---|
| ``fp8`` | per tensor, dynamic per tensor (vLLM's ``--quantization fp8``) | Fp8Config (``quant_method: fp8``) without blocks |
| ``fp8_per_tensor`` | per tensor, dynamic per tensor | compressed-tensors FP8 (static activations) |
| ``fp8_per_channel`` | per output channel, dynamic per token | compressed-tensors FP8_DYNAMIC |
| ``fp8_per_block`` | per 128x128 block, dynamic per token and 128 columns | Fp8Config with ``weight_block_size: [128, 128]``, compressed-tensors FP8_BLOCK |
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from pagellm.platforms import current_platform
from pagellm.quantization import LinearMethodBase, QuantizationConfig, UnquantizedLinearMethod
from pagellm.quantization.fp8_formats import E4M3FN, FP8_FORMATS
from pagellm.quantization.layers import checkpoint_layer_names, is_ignored_layer
from pagellm_fp8.checkpoint_formats import (
    COMPRESSED_TENSORS,
    FP8_CONFIG,
    checkpoint_weights,
    parse_checkpoint,
)
from pagellm_fp8.gemm import gemm_refusal
from pagellm_fp8.linear_method import Fp8LinearMethod
from pagellm_fp8.scheme import Fp8Scheme, WeightGranularity


def platform_fp8_dtype() -> torch.dtype:
    """The float8 format the current platform computes in. A platform without one (None) is
    refused off the CPU by `_Fp8ConfigBase.platform_refusal`; on the CPU the reference path
    computes in float32 from the checkpoint's own format."""
    fp8 = current_platform.fp8_dtype()
    return fp8 if fp8 in FP8_FORMATS else E4M3FN


class _Fp8ConfigBase(QuantizationConfig):
    weights: ClassVar[WeightGranularity]
    online_scheme: ClassVar[Fp8Scheme]
    checkpoint_formats: ClassVar[tuple[str, ...]]

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        if not config:
            return cls(cls.online_scheme)
        scheme = parse_checkpoint(config)
        if not cls.matches_checkpoint(config):
            raise ValueError(
                f"{cls.name} does not read this checkpoint ({config.get('quant_method')!r} with "
                f"{scheme.weights} weight scales)."
            )
        return cls(scheme)

    @classmethod
    def matches_checkpoint(cls, checkpoint_config: dict[str, Any]) -> bool:
        return (
            checkpoint_config.get("quant_method") in cls.checkpoint_formats
            and checkpoint_weights(checkpoint_config) == cls.weights
        )

    @classmethod
    def tensor_parallel_refusal(cls, tp_size: int, checkpoint_config: dict[str, Any]) -> str | None:
        """Every scheme splits: online quantization quantizes each rank's float slice after
        loading (a per-tensor scale is then per rank), an fp8 checkpoint's tensors are cut
        where `Fp8LinearMethod.checkpoint_split` says (block scales by whole 128x128 blocks,
        checked when the model is built)."""
        return None

    @classmethod
    def platform_refusal(cls, device_type: str, dtype: torch.dtype) -> str | None:
        fp8 = current_platform.fp8_dtype() if device_type != "cpu" else None
        return gemm_refusal(cls.weights, device_type, dtype, platform_fp8=fp8)

    def get_linear_method(self, prefix: str) -> LinearMethodBase:
        names = checkpoint_layer_names(prefix)
        ignored = [is_ignored_layer(n, self.scheme.ignored) for n in names]
        if all(ignored):
            return UnquantizedLinearMethod()
        if any(ignored):
            raise ValueError(
                f"The checkpoint leaves some parts of fused layer {prefix} ({names}) unquantized "
                "and quantizes others; pagellm fuses them into one layer of one format."
            )
        return Fp8LinearMethod(
            dataclasses.replace(self.scheme, fp8_dtype=platform_fp8_dtype()), prefix
        )


class Fp8Config(_Fp8ConfigBase):
    name = "fp8"
    weights = "tensor"
    online_scheme = Fp8Scheme("tensor", "tensor")
    checkpoint_formats = (FP8_CONFIG,)


class Fp8PerTensorConfig(_Fp8ConfigBase):
    name = "fp8_per_tensor"
    weights = "tensor"
    online_scheme = Fp8Scheme("tensor", "tensor")
    checkpoint_formats = (COMPRESSED_TENSORS,)


class Fp8PerChannelConfig(_Fp8ConfigBase):
    name = "fp8_per_channel"
    weights = "channel"
    online_scheme = Fp8Scheme("channel", "token")
    checkpoint_formats = (COMPRESSED_TENSORS,)


class Fp8PerBlockConfig(_Fp8ConfigBase):
    name = "fp8_per_block"
    weights = "block"
    online_scheme = Fp8Scheme("block", "group")
    checkpoint_formats = (FP8_CONFIG, COMPRESSED_TENSORS)
