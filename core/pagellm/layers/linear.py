"""Linear and embedding layers. A linear layer's parameters belong to its linear method (dense by
default, or a quantization method's), so quantization plugins change layers without changing models."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.quantization.base import (
    LayerSplit,
    LinearMethodBase,
    QuantizationConfig,
    QuantizedActivation,
)
from pagellm.quantization.unquantized import UnquantizedLinearMethod


class TensorSlice(Protocol):
    """A checkpoint tensor not read yet (safetensors' ``get_slice``): indexing reads that part."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: object) -> torch.Tensor: ...


CheckpointTensor = torch.Tensor | TensorSlice


def checkpoint_shape(tensor: CheckpointTensor) -> tuple[int, ...]:
    return tuple(tensor.shape if isinstance(tensor, torch.Tensor) else tensor.get_shape())


def materialize(tensor: CheckpointTensor) -> torch.Tensor:
    """The whole tensor (read from the file when it is a lazy slice; ``[...]``, not ``[:]``,
    which a 0-dim slice refuses)."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor[...]


class Linear(nn.Module):
    """A linear layer held whole by every rank; the parallel layers (`parallel_linear`) subclass
    it, describe their rank's part in ``tp_split`` and override `rank_part` to keep only their
    rank's slice of each checkpoint tensor."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        output_sizes: list[int] | None = None,
        tp_split: LayerSplit | None = None,
    ) -> None:
        super().__init__()
        # The output rows of each fused part (q, k, v of qkv_proj), for methods whose scales
        # are per part in the checkpoint.
        self.output_sizes = output_sizes or [out_features]
        if sum(self.output_sizes) != out_features:
            raise ValueError(f"output_sizes {output_sizes} do not add up to {out_features}.")
        # Set before create_weights: this rank's part of the whole layer (None: it is whole).
        self.tp_split = tp_split
        self.linear_method: LinearMethodBase = (
            quant_config.get_linear_method(prefix) if quant_config else UnquantizedLinearMethod()
        )
        self.linear_method.create_weights(
            self, in_features, out_features, bias, torch.get_default_dtype()
        )

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        return self.matmul(x)

    def matmul(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        """This rank's product: ``x`` plain, or quantized by the layer that produced it as this
        layer's method asked (`pagellm.layers.input_producer`)."""
        if isinstance(x, QuantizedActivation):
            return self.linear_method.apply_quantized(self, x)
        return self.linear_method.apply(self, x)

    def forward_into(
        self, x: torch.Tensor | QuantizedActivation, out: torch.Tensor
    ) -> torch.Tensor:
        """``forward(x)`` written into ``out`` (contiguous, [tokens, out_features]) and returned:
        by the matmul itself for unquantized weights of a 2-D input (the same ``mm`` / ``addmm``
        as ``F.linear``), else copied there. Piecewise graphs give their q/k/v buffer."""
        if (
            type(self.linear_method) is UnquantizedLinearMethod
            and isinstance(x, torch.Tensor)
            and x.dim() == 2
            and not getattr(self, "gather_output", False)
        ):
            weight = self.get_parameter("weight").t()
            bias = self.bias
            if bias is None:
                return torch.mm(x, weight, out=out)
            return torch.addmm(bias, x, weight, out=out)  # type: ignore[arg-type]
        return out.copy_(self.forward(x))

    def rank_part(
        self, param_name: str, tensor: CheckpointTensor, name: str, shard: int | None
    ) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` (for parameter ``param_name``, of fused
        part ``shard``): all of it."""
        return materialize(tensor)

    def load_checkpoint_tensor(
        self, param_name: str, tensor: CheckpointTensor, name: str, shard: int | None
    ) -> None:
        """Copy this rank's part of checkpoint tensor ``name`` into parameter ``param_name``, into
        the rows of fused part ``shard`` (None: an unfused layer)."""
        rows = None
        if shard is not None:
            rows = (sum(self.output_sizes[:shard]), self.output_sizes[shard])
        param = self.get_parameter(param_name)
        load_parameter(param, self.rank_part(param_name, tensor, name, shard), name, shard, rows)


class VocabEmbedding(nn.Module):
    """The token embedding (and, untied, the LM head's weight); weights start empty for the loader."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


def load_parameter(
    param: nn.Parameter,
    tensor: torch.Tensor,
    name: str,
    shard: int | None = None,
    rows: tuple[int, int] | None = None,
) -> None:
    """Copy checkpoint tensor ``name`` into ``param`` (into ``rows`` = (offset, count) when it is
    part ``shard`` of a fused layer). A parameter with a ``weight_loader`` (a quantization
    method's: scales, float8 weights) loads itself, from ``shard`` alone."""
    weight_loader = getattr(param, "weight_loader", None)
    if weight_loader is not None:
        weight_loader(param, tensor, shard)
        return
    dst = param.data if rows is None else param.data.narrow(0, rows[0], rows[1])
    if dst.shape != tensor.shape:
        raise ValueError(
            f"Checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}."
        )
    dst.copy_(tensor)
