"""Model classes by the HF ``architectures`` name; out-of-tree models register here too."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "pagellm.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pagellm.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "pagellm.models.qwen:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "pagellm.models.qwen:Qwen3ForCausalLM",
}


def register_model(architecture: str, qualname: str) -> None:
    """Register ``"package.module:Class"`` for a HF architecture name (last registration wins)."""
    _MODELS[architecture] = qualname


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def is_supported(architecture: str) -> bool:
    return architecture in _MODELS


def resolve_model_cls(architectures: list[str]) -> tuple[str, type[nn.Module]]:
    for arch in architectures:
        if arch in _MODELS:
            module_name, _, cls_name = _MODELS[arch].partition(":")
            return arch, getattr(importlib.import_module(module_name), cls_name)
    raise ValueError(
        f"Model architecture(s) {architectures} are not supported; supported: "
        f"{', '.join(supported_architectures())}."
    )
