"""RMSNorm, with the residual add fused in the vLLM way: ``norm(x, residual) -> (out, x + residual)``;
``out`` is a `QuantizedActivation` when the norm feeds a linear layer whose quantization method
quantizes its input in the norm's kernel (`InputProducer`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.custom_ops import get_custom_op
from pagellm.layers.input_producer import InputProducer
from pagellm.quantization.base import QuantizedActivation

NormOutput = torch.Tensor | QuantizedActivation


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in torch: normalised in float32, then scaled in ``x``'s dtype (as the HF reference
    does); what the platforms' kernels must match."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


class RMSNorm(nn.Module, InputProducer):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self._rms_norm_op = get_custom_op("rms_norm")
        self._fused_add_op = get_custom_op("fused_add_rms_norm")

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_torch(x, self.weight, self.eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> NormOutput | tuple[NormOutput, torch.Tensor]:
        quantizer = self.input_quantizer
        if quantizer is not None:
            fused = (
                quantizer.rms_norm(x, self.weight, self.eps)
                if residual is None
                else quantizer.fused_add_rms_norm(x, residual, self.weight, self.eps)
            )
            if fused is not None:
                return fused
        if residual is None:
            if self._rms_norm_op is not None:
                # [tokens, heads, head_size] views (per-head q/k norms) go as they are: their
                # rows cannot be one strided 2-D view, and reshaping would copy them.
                rows = x if x.dim() in (2, 3) else x.reshape(-1, x.shape[-1])
                return self._rms_norm_op(rows, self.weight, self.eps).view(x.shape)
            return self._norm(x)
        if self._fused_add_op is not None:
            return self._fused_add_op(x, residual, self.weight, self.eps)
        x = x + residual
        return self._norm(x), x
