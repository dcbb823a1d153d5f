"""Linear and embedding layers. A linear layer's parameters belong to its linear method (dense by
default, or a quantization method's), so quantization plugins change layers without changing models."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.quantization.base import LinearMethodBase, QuantizationConfig
from pagellm.quantization.unquantized import UnquantizedLinearMethod


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.linear_method: LinearMethodBase = (
            quant_config.get_linear_method(prefix) if quant_config else UnquantizedLinearMethod()
        )
        self.linear_method.create_weights(
            self, in_features, out_features, bias, torch.get_default_dtype()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x)


class VocabEmbedding(nn.Module):
    """The token embedding (and, untied, the LM head's weight); weights start empty for the loader."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)
