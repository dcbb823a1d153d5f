"""Model classes by the HF ``architectures`` name; out-of-tree models register here too, from a
general plugin's ``pagellm_register`` hook."""

from __future__ import annotations

from torch import nn

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
register_model = models.register


def resolve_model_cls(architectures: list[str]) -> tuple[str, type[nn.Module]]:
    for arch in architectures:
        if arch in models:
            return arch, models.get(arch)
    raise ValueError(
        f"Model architecture(s) {architectures} are not supported; supported: "
        f"{', '.join(sorted(models.names()))}."
    )
