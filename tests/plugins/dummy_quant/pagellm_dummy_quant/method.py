"""Weight-only int8: dense weights are loaded, then rounded to int8 with one scale per row."""

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.quantization import LinearMethodBase, QuantizationConfig


class Int8WeightOnlyLinearMethod(LinearMethodBase):
    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        out_features: int,
        bias: bool,
        params_dtype: torch.dtype,
    ) -> None:
        layer.register_parameter(
            "weight",
            nn.Parameter(
                torch.empty(out_features, in_features, dtype=params_dtype), requires_grad=False
            ),
        )
        layer.register_parameter(
            "bias",
            nn.Parameter(torch.empty(out_features, dtype=params_dtype), requires_grad=False)
            if bias
            else None,
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.data
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
        layer.register_buffer("qweight", torch.round(weight / scale).to(torch.int8))
        layer.register_buffer("scale", scale)
        del layer.weight  # only the int8 copy stays

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.qweight.to(x.dtype) * layer.scale.to(x.dtype), layer.bias)


class Int8WeightOnlyConfig(QuantizationConfig):
    name = "dummy_int8"
    supported_dtypes = (torch.float32,)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Int8WeightOnlyConfig":
        return cls()

    def get_linear_method(self, prefix: str) -> LinearMethodBase:
        return Int8WeightOnlyLinearMethod()
