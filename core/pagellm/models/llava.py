"""LLaVA: a CLIP vision tower, a two-layer projector (linear, activation, linear) and a decoder of
the Llama family (Llama, Mistral, Qwen2), as Hugging Face's ``LlavaForConditionalGeneration``.

An image is one `MultiModalItem` of modality ``image``: its pixel tensor (3 × size × size, as the
image processor made it) and a span of ``image_token_id`` placeholders in the prompt, one per
patch of the vision feature layer (the class token dropped under
``vision_feature_select_strategy: default``, kept under ``full``). The workers run
`embed_multimodal` on the pixels and put its rows in place of the placeholders' token embeddings
(`pagellm.worker.multimodal`); the decoder then runs as for text.

Checkpoint names are taken in both of Hugging Face's layouts: ``language_model.model.*`` /
``language_model.lm_head.*`` / ``vision_tower.vision_model.*`` (what ``save_pretrained`` writes and
the hub's llava-hf checkpoints hold) and ``model.language_model.*`` / ``lm_head.*`` /
``model.vision_tower.*``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

from pagellm.attention import AttentionBackend
from pagellm.config import EngineConfig
from pagellm.layers.linear import CheckpointTensor, load_parameter, materialize
from pagellm.models.clip import CLIPVisionTower, activation
from pagellm.models.llama import LlamaForCausalLM
from pagellm.models.registry import models
from pagellm.models.segments import SegmentedDecoder
from pagellm.multimodal.inputs import MultiModalSpec
from pagellm.quantization.base import QuantizationConfig

# The decoder class of each text model type LLaVA checkpoints pair with the vision tower.
_DECODERS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# Checkpoint prefixes (either layout) → this module's.
_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
    ("vision_tower.vision_model.", "vision_tower."),
)


def _feature_layers(cfg: Any) -> list[int]:
    layer = getattr(cfg, "vision_feature_layer", -2)
    return [int(layer)] if isinstance(layer, int) else [int(i) for i in layer]


def _strategy(cfg: Any) -> str:
    strategy = getattr(cfg, "vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise NotImplementedError(
            f"vision_feature_select_strategy {strategy!r} is not supported (default or full)."
        )
    return str(strategy)


def _image_token_id(cfg: Any) -> int:
    token = getattr(cfg, "image_token_id", None)
    return int(token if token is not None else cfg.image_token_index)


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        in_features = cfg.vision_config.hidden_size * len(_feature_layers(cfg))
        hidden = cfg.text_config.hidden_size
        bias = bool(getattr(cfg, "multimodal_projector_bias", True))
        self.linear_1 = nn.Linear(in_features, hidden, bias=bias)
        self.act = activation(getattr(cfg, "projector_hidden_act", "gelu"))
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(nn.Module):
    default_io_processor = "image"
    """The IO processor that turns its requests' images into items (`pagellm-io-image`)."""

    @classmethod
    def multimodal_specs(cls, hf_config: Any) -> list[MultiModalSpec]:
        vision = hf_config.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2
        tokens = patches + (1 if _strategy(hf_config) == "full" else 0)
        shape = (int(vision.num_channels), int(vision.image_size), int(vision.image_size))
        return [MultiModalSpec("image", _image_token_id(hf_config), tokens, shape)]

    def __init__(
        self,
        config: EngineConfig,
        attn_backend: type[AttentionBackend],
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        cfg = config.model.hf_config
        self.drops_class_token = _strategy(cfg) == "default"
        self.vision_tower = CLIPVisionTower(cfg.vision_config, _feature_layers(cfg))
        self.multi_modal_projector = LlavaMultiModalProjector(cfg)
        text_type = getattr(cfg.text_config, "model_type", "llama")
        if text_type not in _DECODERS:
            raise NotImplementedError(
                f"LLaVA with a {text_type!r} text model is not supported; supported: "
                f"{', '.join(_DECODERS)}."
            )
        decoder_cls = cast(type[LlamaForCausalLM], models.get(_DECODERS[text_type]))
        self.language_model = decoder_cls(config, attn_backend, quant_config)

    def embed_multimodal(self, modality: str, pixel_values: torch.Tensor) -> torch.Tensor:
        """Images (batch × 3 × size × size) → their embeddings (batch × tokens × hidden), the
        rows that replace their placeholder tokens."""
        if modality != "image":
            raise ValueError(f"LLaVA embeds images, not {modality!r} items.")
        features = self.vision_tower(pixel_values)
        if self.drops_class_token:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def segmented_decoder(self) -> SegmentedDecoder:
        """The language model's, for steps with no image rows (the runner runs those eagerly)."""
        return self.language_model.segmented_decoder()

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """The vision tower's and projector's tensors are copied here, the decoder's streamed
        to its own `load_weights` (renamed to its HF names); returns the parameters set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def decoder_weights() -> Iterator[tuple[str, CheckpointTensor]]:
            for name, tensor in weights:
                target = name
                for old, new in _PREFIXES:
                    if target.startswith(old):
                        target = new + target.removeprefix(old)
                        break
                if target.startswith("language_model."):
                    yield target.removeprefix("language_model."), tensor
                    continue
                tower = target.removeprefix("vision_tower.")
                if target.startswith("vision_tower.") and self.vision_tower.skips(tower):
                    continue
                if target not in params:
                    raise ValueError(
                        f"Checkpoint tensor {name!r} matches no parameter of {type(self).__name__}."
                    )
                load_parameter(params[target], materialize(tensor), name)
                loaded.add(target)

        decoder_loaded = self.language_model.load_weights(decoder_weights())
        return loaded | {f"language_model.{name}" for name in decoder_loaded}
