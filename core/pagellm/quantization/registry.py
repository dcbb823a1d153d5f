"""Quantization methods by name (what ``--quantization`` takes); plugins add theirs here."""

from __future__ import annotations

import importlib

from pagellm.quantization.base import QuantizationConfig

_METHODS: dict[str, str] = {}


def register_quantization_method(name: str, qualname: str) -> None:
    _METHODS[name] = qualname


def registered_quantization_methods() -> list[str]:
    from pagellm.plugins import load_quantization_plugins

    load_quantization_plugins()
    return sorted(_METHODS)


def get_quantization_config_cls(name: str) -> type[QuantizationConfig]:
    if name not in registered_quantization_methods():
        installed = ", ".join(registered_quantization_methods()) or "none installed"
        raise ValueError(
            f"quantization={name!r} is not an installed quantization method ({installed})."
        )
    module_name, _, cls_name = _METHODS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    if not (isinstance(cls, type) and issubclass(cls, QuantizationConfig)):
        raise TypeError(
            f"{_METHODS[name]} registered as quantization method {name!r} is not a QuantizationConfig."
        )
    return cls
