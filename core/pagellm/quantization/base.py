"""The quantization interfaces: a method family's config, and how it runs a linear layer.

The full contract (weight creation, loading and repacking, checkpoint detection, platform
refusal) is written down in docs/plugins.md, "The quantization method contract"."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn


class LinearMethodBase(ABC):
    """Owns a linear layer's parameters: creates them, post-processes them after loading, applies them.

    A parameter may carry a ``weight_loader(param, tensor, shard)`` attribute: the model's
    `load_weights` then hands it each checkpoint tensor for that parameter (``shard`` is the
    index of the fused part, e.g. 1 for k_proj in qkv_proj, or None for an unfused layer) instead
    of copying rows itself. The layer's ``output_sizes`` lists the fused parts' output rows."""

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

    reads_model_format: ClassVar[str | None] = None
    """The weight-file format whose own quantized tensors this method keeps (``"gguf"``), so
    that it refuses any other model; None: it reads checkpoints of any format."""

    @classmethod
    def matches_checkpoint(cls, checkpoint_config: dict[str, Any]) -> bool:
        """True when this method is the one that reads a checkpoint whose config.json has this
        ``quantization_config``: the engine then picks it without ``--quantization``."""
        return False

    @classmethod
    def tensor_parallel_refusal(cls, tp_size: int, checkpoint_config: dict[str, Any]) -> str | None:
        """Why this method cannot run split over ``tp_size`` > 1 ranks for a checkpoint with this
        ``quantization_config`` (empty: float weights), or None when it can. A method that can
        receives each checkpoint tensor already cut to the rank's part (see docs/plugins.md);
        by default methods refuse, since a packed layout need not split where floats do."""
        return (
            f"quantization {cls.name} does not support tensor_parallel_size {tp_size} yet; "
            "use tensor_parallel_size 1 or a float checkpoint."
        )

    @classmethod
    def platform_refusal(cls, device_type: str, dtype: torch.dtype) -> str | None:
        """Why this method cannot run on this process's ``device_type`` device with model
        ``dtype`` (checked when the engine config is built), or None when it can."""
        return None
