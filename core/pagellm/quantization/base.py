"""The quantization interfaces: a method family's config, and how it runs a linear layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn


class LinearMethodBase(ABC):
    """Owns a linear layer's parameters: creates them, post-processes them after loading, applies them."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        in_features: int,
        out_features: int,
        bias: bool,
        params_dtype: torch.dtype,
    ) -> None:
        """Register the layer's parameters (their names are what the checkpoint provides)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor: ...

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 (optional hook)
        """Repack or convert the loaded weights (e.g. to a kernel's layout)."""


class QuantizationConfig(ABC):
    name: ClassVar[str]
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.float32,
        torch.float16,
        torch.bfloat16,
    )

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Build from the checkpoint's ``quantization_config`` (empty when it has none)."""

    @abstractmethod
    def get_linear_method(self, prefix: str) -> LinearMethodBase:
        """The method for the linear layer named ``prefix`` (e.g. ``model.layers.0.mlp.down_proj``)."""
