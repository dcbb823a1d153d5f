"""The input quantizer contract (docs/plugins.md): a linear method's `InputQuantizer` makes the
norm or activation that produces the layer's input hand it a `QuantizedActivation`, which only
`apply_quantized` reads; a quantizer that declines a call (None) leaves the producer unfused.

The method here is a test one that "quantizes" to float16 with a per-row scale, so the fused
and unfused results can be compared exactly; pagellm-fp8's is tested in its package."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.layers.activation import SiluAndMul
from pagellm.layers.layernorm import RMSNorm, rms_norm_torch
from pagellm.layers.linear import Linear
from pagellm.model_loader.loader import _after_loading
from pagellm.quantization import (
    InputQuantizer,
    LinearMethodBase,
    QuantizationConfig,
    QuantizedActivation,
)


def _halves(y: torch.Tensor) -> QuantizedActivation:
    scale = y.abs().amax(dim=-1, keepdim=True).clamp(min=1e-6)
    return QuantizedActivation((y / scale).half(), scale, y.dtype)


class HalvesQuantizer(InputQuantizer):
    """Fuses the norm (for up to ``max_rows`` rows) and nothing else."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.calls = 0

    def rms_norm(self, x, weight, eps):
        if x.shape[0] > self.max_rows:
            return None
        self.calls += 1
        return _halves(rms_norm_torch(x, weight, eps))

    def fused_add_rms_norm(self, x, residual, weight, eps):
        if x.shape[0] > self.max_rows:
            return None
        self.calls += 1
        total = x + residual
        return _halves(rms_norm_torch(total, weight, eps)), total


class HalvesMethod(LinearMethodBase):
    def __init__(self) -> None:
        self.quantizer = HalvesQuantizer(max_rows=4)

    def create_weights(self, layer, in_features, out_features, bias, params_dtype):
        weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))
        layer.register_parameter("bias", None)

    def apply(self, layer, x):
        return self.apply_quantized(layer, _halves(x))

    def input_quantizer(self, layer):
        return self.quantizer

    def apply_quantized(self, layer, x):
        return (x.data.float() * x.scale) @ layer.weight.t()


class HalvesConfig(QuantizationConfig):
    name = "halves"

    @classmethod
    def from_config(cls, config):
        return cls()

    def get_linear_method(self, prefix):
        return HalvesMethod()


class NormThenLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(16)
        self.proj = Linear(16, 8, quant_config=HalvesConfig())
        self.act = SiluAndMul()
        self.norm.feeds(self.proj)

    def forward(self, x, residual=None):
        if residual is None:
            return self.proj(self.norm(x))
        out, residual = self.norm(x, residual)
        return self.proj(out), residual


def test_a_bound_norm_hands_its_layer_the_methods_quantized_input():
    model = _after_loading(NormThenLinear())
    quantizer = model.norm.input_quantizer
    assert isinstance(quantizer, HalvesQuantizer)
    assert model.act.input_quantizer is None  # paired with nothing
    x, residual = torch.randn(3, 16), torch.randn(3, 16)

    fused = model(x)
    fused_out, fused_residual = model(x, residual)

    assert quantizer.calls == 2
    assert torch.equal(fused, model.proj(rms_norm_torch(x, model.norm.weight, model.norm.eps)))
    unfused_out, unfused_residual = model.norm._norm(x + residual), x + residual
    assert torch.equal(fused_out, model.proj(unfused_out))
    assert torch.equal(fused_residual, unfused_residual)


def test_a_call_the_quantizer_declines_runs_the_producer_unfused():
    model = _after_loading(NormThenLinear())
    x = torch.randn(5, 16)  # more rows than the quantizer fuses
    out = model.norm(x)
    assert isinstance(out, torch.Tensor) and model.norm.input_quantizer.calls == 0
    assert torch.equal(out, rms_norm_torch(x, model.norm.weight, model.norm.eps))


def test_a_method_without_a_quantizer_leaves_producers_plain():
    norm, proj = RMSNorm(16), Linear(16, 8)
    proj.weight.data.normal_()
    norm.feeds(proj)
    norm.bind_input_quantizer()
    assert norm.input_quantizer is None
    x = torch.randn(2, 16)
    assert isinstance(norm(x), torch.Tensor)
