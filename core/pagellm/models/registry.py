"""Model classes by the HF ``architectures`` name; out-of-tree models register here too, from a
general plugin's ``pagellm_register`` hook.

A model class may declare ``runners`` (what the engine can do with it: ``("generate",)``, the
default, or ``("pooling",)`` for an embedding model with a ``pooler``) and ``is_causal`` (False:
bidirectional attention, an encoder's; default True)."""

from __future__ import annotations

from typing import cast

from torch import nn

from pagellm.config import Runner
from pagellm.plugins.groups import GENERAL
from pagellm.plugins.registry import Registry

models: Registry[nn.Module] = Registry("Model architecture", nn.Module, GENERAL)
models.register("LlamaForCausalLM", "pagellm.models.llama:LlamaForCausalLM")
models.register("MistralForCausalLM", "pagellm.models.llama:MistralForCausalLM")
models.register("Qwen2ForCausalLM", "pagellm.models.qwen:Qwen2ForCausalLM")
models.register("Qwen3ForCausalLM", "pagellm.models.qwen:Qwen3ForCausalLM")
models.register(
    "LlavaForConditionalGeneration", "pagellm.models.llava:LlavaForConditionalGeneration"
)
models.register("BertModel", "pagellm.models.bert:BertModel")
register_model = models.register


def resolve_model_cls(architectures: list[str]) -> tuple[str, type[nn.Module]]:
    for arch in architectures:
        if arch in models:
            return arch, models.get(arch)
    raise ValueError(
        f"Model architecture(s) {architectures} are not supported; supported: "
        f"{', '.join(sorted(models.names()))}."
    )


def model_runners(model_cls: type[nn.Module]) -> tuple[Runner, ...]:
    """The runners the class supports (`Runner`), the first being its default."""
    return cast(tuple[Runner, ...], tuple(getattr(model_cls, "runners", ("generate",))))


def model_is_causal(model_cls: type[nn.Module]) -> bool:
    return bool(getattr(model_cls, "is_causal", True))
