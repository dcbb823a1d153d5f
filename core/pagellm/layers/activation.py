import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.custom_ops import get_custom_op
from pagellm.layers.input_producer import InputProducer
from pagellm.quantization.base import QuantizedActivation


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` in torch (two ops, two roundings to ``x``'s dtype)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module, InputProducer):
    """``silu(gate) * up`` on the fused gate_up projection's output (a `QuantizedActivation`
    when it feeds a linear layer whose method quantizes its input here: `InputProducer`)."""

    def __init__(self) -> None:
        super().__init__()
        self._op = get_custom_op("silu_and_mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor | QuantizedActivation:
        if self.input_quantizer is not None:
            fused = self.input_quantizer.silu_and_mul(x)
            if fused is not None:
                return fused
        if self._op is not None:
            return self._op(x)
        return silu_and_mul_torch(x)
