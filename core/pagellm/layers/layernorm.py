"""RMSNorm, with the residual add fused in the vLLM way: ``norm(x, residual) -> (out, x + residual)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.custom_ops import get_custom_op


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self._rms_norm_op = get_custom_op("rms_norm")
        self._fused_add_op = get_custom_op("fused_add_rms_norm")

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, then scale in the model's dtype (as the HF reference does).
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
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
