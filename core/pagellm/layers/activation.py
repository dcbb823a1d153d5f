import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.custom_ops import get_custom_op


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` on the fused gate_up projection's output."""

    def __init__(self) -> None:
        super().__init__()
        self._op = get_custom_op("silu_and_mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._op is not None:
            return self._op(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
