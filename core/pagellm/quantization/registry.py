"""Quantization methods by name (what ``--quantization`` takes); plugins add theirs here."""

from __future__ import annotations

from pagellm.plugins.class_registry import ClassRegistry
from pagellm.quantization.base import QuantizationConfig


def _load_plugins() -> None:
    from pagellm.plugins import load_quantization_plugins

    load_quantization_plugins()


_REGISTRY: ClassRegistry[QuantizationConfig] = ClassRegistry(
    "quantization method",
    QuantizationConfig,  # type: ignore[type-abstract]  # only used for the subclass check
    _load_plugins,
)
register_quantization_method = _REGISTRY.register
registered_quantization_methods = _REGISTRY.names


def get_quantization_config_cls(name: str) -> type[QuantizationConfig]:
    if name not in registered_quantization_methods():
        installed = ", ".join(registered_quantization_methods()) or "none installed"
        raise ValueError(
            f"quantization={name!r} is not an installed quantization method ({installed})."
        )
    return _REGISTRY.get(name)
