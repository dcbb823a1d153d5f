"""The quantization interfaces: a method family's config, and how it runs a linear layer.

The full contract (weight creation, loading and repacking, checkpoint detection, platform
refusal) is written down in docs/plugins.md, "The quantization method contract"."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import nn

if TYPE_CHECKING:
    from pagellm.layers.linear import CheckpointTensor

ParallelKind = Literal["column", "row"]
"""What a tensor-parallel linear layer splits: its output features (column-parallel: each fused
part on its own) or its input features (row-parallel)."""


@dataclass(frozen=True)
class LayerSplit:
    """How one rank's linear layer is part of the whole layer (``layer.tp_split``; None with one
    rank): read by a linear method in `create_weights` (a scale held whole needs the whole
    layer's group count) and given to its `checkpoint_split`."""

    parallel: ParallelKind
    tp_size: int
    rank: int
    full_in_features: int
    full_output_sizes: tuple[int, ...]
    """The whole layer's output features of each fused part (q, k, v of ``qkv_proj``)."""


@dataclass(frozen=True)
class TensorSplit:
    """Where a rank's part of one checkpoint tensor lies: along dimension ``dim``, on which every
    ``features`` consecutive features of the layer's split dimension (output features of the
    part, or input features) take ``entries`` consecutive entries. A float weight [N, K]: 1 and
    1; GPTQ's ``qweight`` [K/8, N] cut by input features: 8 and 1 (eight 4-bit values a word);
    a scale per group of 128 inputs: 128 and 1; a Q4_K row of bytes: 256 inputs a 144-byte
    block, so 256 and 144. A rank's features must start and end on a multiple of ``features``,
    or loading fails with a `TensorParallelError` that names the ``unit``."""

    dim: int
    features: int = 1
    entries: int = 1
    unit: str = "feature"
    """What ``features`` features make, for error messages (``quantization group``)."""


@dataclass(frozen=True)
class QuantizedActivation:
    """A linear layer's input, quantized by the layer that produced it through the layer's
    method's `InputQuantizer`: only that method reads it (`LinearMethodBase.apply_quantized`)."""

    data: torch.Tensor
    """The quantized values, [..., K] in the method's format."""
    scale: torch.Tensor
    """Their scales, in the shape the method's GEMM takes (per tensor, per row, per group)."""
    dtype: torch.dtype
    """The dtype of the activation it stands for: what the layer's output is written in."""


class InputQuantizer:
    """A linear method's quantization of its layer's input, fused into the layer that produces
    that input (`LinearMethodBase.input_quantizer`; the producers are `pagellm.layers`'
    `InputProducer`s: RMSNorm, SiluAndMul). Each method returns what the producer's own
    computation followed by the linear method's quantization would give, rounded the same way,
    or None when it does not fuse this call (a shape or device its kernels do not take): the
    producer then runs as usual and the linear layer quantizes its input itself. By default
    nothing is fused.

    - ``rms_norm(x, weight, eps)``: ``x`` [tokens, hidden], RMSNorm as `RMSNorm` rounds it.
    - ``fused_add_rms_norm(x, residual, weight, eps)``: the residual add and RMSNorm, returning
      the normed input quantized and ``x + residual`` (which may be written into ``residual``).
    - ``silu_and_mul(x)``: ``silu(x[:, :d]) * x[:, d:]`` for ``x`` [tokens, 2 * d]."""

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> QuantizedActivation | None:
        return None

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[QuantizedActivation, torch.Tensor] | None:
        return None

    def silu_and_mul(self, x: torch.Tensor) -> QuantizedActivation | None:
        return None


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

    def input_quantizer(self, layer: nn.Module) -> InputQuantizer | None:
        """The quantization of ``layer``'s input that the layer producing it may do instead
        (asked once the weights are processed), or None (the default): the layer then gets
        plain activations. A method that returns one gets its `QuantizedActivation`s in
        `apply_quantized`."""
        return None

    def apply_quantized(self, layer: nn.Module, x: QuantizedActivation) -> torch.Tensor:
        """`apply` for an input already quantized by this method's `input_quantizer`."""
        raise NotImplementedError(
            f"{type(self).__name__} offers no input quantizer, so it takes no quantized input."
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 (optional hook)
        """Repack or convert the loaded weights (e.g. to a kernel's layout)."""

    def checkpoint_split(
        self, param_name: str, tensor: CheckpointTensor, split: LayerSplit
    ) -> TensorSplit | None:
        """The shard hook: where this rank's part of checkpoint tensor ``tensor`` (for parameter
        ``param_name``) lies in a layer split over ranks as ``split`` says, or None for a tensor
        every rank takes whole (a per-tensor scale). The layer cuts the tensor there (reading
        only that part of a lazy safetensors slice) before the parameter's loader gets it.

        Default, float weights: ``weight`` [N, K] along its output rows (column-parallel) or
        input columns (row-parallel), a column-parallel ``bias`` along its rows (a row-parallel
        bias goes whole to the first rank, zeros to the others), anything else whole."""
        if param_name == "weight":
            return TensorSplit(0 if split.parallel == "column" else 1)
        if param_name == "bias" and split.parallel == "column":
            return TensorSplit(0)
        return None


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
        receives each checkpoint tensor already cut to the rank's part, where its linear
        methods' `LinearMethodBase.checkpoint_split` says (see docs/plugins.md); by default
        methods refuse, since a packed layout need not split where floats do."""
        return (
            f"quantization {cls.name} does not support tensor_parallel_size {tp_size} yet; "
            "use tensor_parallel_size 1 or a float checkpoint."
        )

    @classmethod
    def platform_refusal(cls, device_type: str, dtype: torch.dtype) -> str | None:
        """Why this method cannot run on this process's ``device_type`` device with model
        ``dtype`` (checked when the engine config is built), or None when it can."""
        return None
