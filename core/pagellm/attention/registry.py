"""Attention backends by name: the built-in one, and those of `pagellm.attention_backends` plugins
(loaded on first use, in whichever process chooses or builds a backend)."""

from __future__ import annotations

import importlib

from pagellm.attention.backend import AttentionBackend

_BACKENDS: dict[str, str] = {}


def register_backend(name: str, qualname: str) -> None:
    """Register ``"package.module:Class"`` under ``name`` (last registration wins)."""
    _BACKENDS[name] = qualname


def registered_backends() -> list[str]:
    from pagellm.plugins import load_attention_plugins

    load_attention_plugins()
    return list(_BACKENDS)


def get_backend_cls(name: str) -> type[AttentionBackend]:
    if name not in registered_backends():
        raise ValueError(
            f"Unknown attention backend {name!r}; installed backends: {', '.join(_BACKENDS)}."
        )
    module_name, _, cls_name = _BACKENDS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    if isinstance(cls, type) and issubclass(cls, AttentionBackend) and cls.name != name:
        raise TypeError(
            f"{_BACKENDS[name]} is registered as {name!r} but its name is {cls.name!r}."
        )
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise TypeError(
            f"{_BACKENDS[name]} registered as attention backend {name!r} is not an AttentionBackend."
        )
    return cls


# The built-in reference backend goes through the same registry as the plugins' backends.
register_backend("TORCH_SDPA", "pagellm.attention.backends.torch_sdpa:TorchSDPABackend")
