"""The bytes a loaded model's weights take, by quantization method: what the start-up line says
(``Weights: 5.46 GiB (gptq 4.52 GiB in 224 linear layers, dense 0.94 GiB)``)."""

from __future__ import annotations

from torch import nn

from pagellm.layers.linear import Linear
from pagellm.quantization import UnquantizedLinearMethod


def _bytes(module: nn.Module, recurse: bool = True) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters(recurse=recurse))


def weight_bytes_by_method(model: nn.Module, method: str | None) -> dict[str, tuple[int, int]]:
    """{method name or "dense": (bytes, linear layers)}; every parameter is counted once, the
    non-linear ones (embeddings, norms) and unquantized linear layers as "dense"."""
    quantized_bytes = quantized_layers = 0
    for module in model.modules():
        if isinstance(module, Linear) and not isinstance(
            module.linear_method, UnquantizedLinearMethod
        ):
            quantized_bytes += _bytes(module)
            quantized_layers += 1
    dense_bytes = _bytes(model) - quantized_bytes
    dense_layers = sum(isinstance(m, Linear) for m in model.modules()) - quantized_layers
    result = {"dense": (dense_bytes, dense_layers)}
    if quantized_layers:
        result = {method or "quantized": (quantized_bytes, quantized_layers), **result}
    return result


def describe_weight_bytes(model: nn.Module, method: str | None) -> str:
    parts = weight_bytes_by_method(model, method)
    total = sum(b for b, _ in parts.values())
    details = ", ".join(
        f"{name} {b / 2**30:.2f} GiB in {n} linear layers"
        if name != "dense" or n
        else f"{name} {b / 2**30:.2f} GiB"
        for name, (b, n) in parts.items()
    )
    return f"Weights: {total / 2**30:.2f} GiB ({details})"
