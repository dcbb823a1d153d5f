"""The CLIP vision transformer, as an image encoder of vision-language models (LLaVA).

Patch embedding (a strided convolution), a class token and learned positions, a pre-norm, then
pre-norm encoder layers with full (non-causal) attention over one image's tokens. It runs on whole
images, outside the paged KV cache: plain torch layers, replicated on every tensor-parallel rank.
Only the layers up to the one whose hidden states the model reads are built (LLaVA reads the
second to last, so the last layer and the post-norm are never run, and their checkpoint tensors
are skipped: `CLIPVisionTower.skips`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation a Hugging Face config names (``hidden_act``, ``projector_hidden_act``)."""
    if name not in ACTIVATIONS:
        raise NotImplementedError(
            f"Activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}."
        )
    return ACTIVATIONS[name]


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        hidden, patch = cfg.hidden_size, cfg.patch_size
        self.class_embedding = nn.Parameter(torch.empty(hidden), requires_grad=False)
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, hidden, kernel_size=patch, stride=patch, bias=False
        )
        num_positions = (cfg.image_size // patch) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, tokens, self.num_heads, -1).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v)  # every token sees every token
        return self.out_proj(out.transpose(1, 2).reshape(batch, tokens, hidden))


class CLIPMLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = CLIPAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = CLIPMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, cfg: Any, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(cfg) for _ in range(num_layers))


class CLIPVisionTower(nn.Module):
    """Images → the hidden states of the chosen layers (Hugging Face's ``hidden_states``
    indices: 0 is the embeddings after the pre-norm, i is the output of layer i; negative ones
    count from the end), concatenated along the hidden dimension."""

    def __init__(self, cfg: Any, feature_layers: list[int]) -> None:
        super().__init__()
        total = int(cfg.num_hidden_layers)
        self.feature_layers = [i + total + 1 if i < 0 else i for i in feature_layers]
        if not all(0 <= i <= total for i in self.feature_layers):
            raise ValueError(
                f"vision_feature_layer {feature_layers} is out of range for a vision tower of "
                f"{total} layers."
            )
        self.num_layers = max(self.feature_layers)
        self.image_size = int(cfg.image_size)
        self.embeddings = CLIPVisionEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)  # HF's name
        self.encoder = CLIPEncoder(cfg, self.num_layers)

    def skips(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` (relative to the tower) belongs to what is not
        built: the post-norm, and the layers after the last one read."""
        if name.startswith("post_layernorm."):
            return True
        if name.startswith("encoder.layers."):
            return int(name.split(".")[2]) >= self.num_layers
        return False

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [hidden]
        for layer in self.encoder.layers:
            hidden = layer(hidden)
            states.append(hidden)
        return torch.cat([states[i] for i in self.feature_layers], dim=-1)
