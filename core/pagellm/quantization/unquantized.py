"""The default: plain dense weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.quantization.base import LinearMethodBase


class UnquantizedLinearMethod(LinearMethodBase):
    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        out_features: int,
        bias: bool,
        params_dtype: torch.dtype,
    ) -> None:
        # Empty: the loader fills the weights, so no time goes into a random initialization.
        weight = torch.empty(out_features, in_features, dtype=params_dtype)
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))
        bias_param = torch.empty(out_features, dtype=params_dtype) if bias else None
        layer.register_parameter(
            "bias",
            nn.Parameter(bias_param, requires_grad=False) if bias_param is not None else None,
        )

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.get_parameter("weight"), layer.bias)  # type: ignore[arg-type]
