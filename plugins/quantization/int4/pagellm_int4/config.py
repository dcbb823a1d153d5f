"""The three registered methods, each the reader of one checkpoint format, picked from the
checkpoint's ``quantization_config`` without a flag:

| method | reads |
|---|---|
| ``gptq`` | ``quant_method: gptq`` (``checkpoint_format`` gptq (v1) or gptq_v2; sym or not; desc_act) |
| ``awq`` | ``quant_method: awq``, ``version: gemm`` |
| ``compressed_tensors_w4a16`` | ``quant_method: compressed-tensors``, ``format: pack-quantized``, int 4-bit weight-only (W4A16, W4A16_ASYM) |

None quantizes a float checkpoint at load: `pagellm_int4.rtn` writes int4 checkpoints offline.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from pagellm.quantization import LinearMethodBase, QuantizationConfig, UnquantizedLinearMethod
from pagellm.quantization.layers import checkpoint_layer_names, is_ignored_layer
from pagellm_int4.checkpoint_formats import checkpoint_format, parse_checkpoint
from pagellm_int4.gemm import gemm_refusal
from pagellm_int4.linear_method import Int4LinearMethod
from pagellm_int4.scheme import Int4Format, Int4Scheme


class _Int4ConfigBase(QuantizationConfig):
    format: ClassVar[Int4Format]

    def __init__(self, scheme: Int4Scheme) -> None:
        self.scheme = scheme

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        if not config:
            raise ValueError(
                f"{cls.name} reads int4 checkpoints and does not quantize a float model at load; "
                "write an int4 checkpoint with `python -m pagellm_int4.rtn` and serve that."
            )
        if checkpoint_format(config) != cls.format:
            raise ValueError(
                f"{cls.name} does not read this checkpoint (quant_method "
                f"{config.get('quant_method')!r})."
            )
        return cls(parse_checkpoint(config))

    @classmethod
    def matches_checkpoint(cls, checkpoint_config: dict[str, Any]) -> bool:
        return checkpoint_format(checkpoint_config) == cls.format

    @classmethod
    def platform_refusal(cls, device_type: str, dtype: torch.dtype) -> str | None:
        return gemm_refusal(device_type, dtype)

    @classmethod
    def tensor_parallel_refusal(cls, tp_size: int, checkpoint_config: dict[str, Any]) -> str | None:
        """Each format splits where `Int4LinearMethod.checkpoint_split` says (by whole packed
        words and quantization groups, checked when the model is built), except act-order
        checkpoints without static groups: their g_idx scatters each group over the inputs,
        so a row-parallel rank would hold parts of groups (`rank_groups`)."""
        try:
            scheme = parse_checkpoint(checkpoint_config)
        except ValueError:
            return None  # from_config says what is wrong with it
        if not scheme.desc_act or checkpoint_config.get("static_groups"):
            return None
        order = "desc_act" if scheme.format == "gptq" else "actorder: group"
        return (
            f"quantization {cls.name} does not support tensor_parallel_size {tp_size} with an "
            f"act-order checkpoint ({order}, without static_groups): its g_idx scatters each "
            "quantization group over the input features, so the row-parallel layers (o_proj, "
            "down_proj) would give each rank parts of groups, which pagellm-int4's kernels "
            "cannot run; use tensor_parallel_size 1, or a checkpoint quantized without "
            "act-order or with static groups."
        )

    def get_linear_method(self, prefix: str) -> LinearMethodBase:
        names = checkpoint_layer_names(prefix)
        ignored = [is_ignored_layer(n, self.scheme.ignored, inner_modules=True) for n in names]
        if all(ignored):
            return UnquantizedLinearMethod()
        if any(ignored):
            raise ValueError(
                f"The checkpoint leaves some parts of fused layer {prefix} ({names}) unquantized "
                "and quantizes others; pagellm fuses them into one layer of one format."
            )
        return Int4LinearMethod(self.scheme, prefix)


class GptqConfig(_Int4ConfigBase):
    name = "gptq"
    format = "gptq"


class AwqConfig(_Int4ConfigBase):
    name = "awq"
    format = "awq"


class CompressedTensorsW4A16Config(_Int4ConfigBase):
    name = "compressed_tensors_w4a16"
    format = "compressed-tensors"
