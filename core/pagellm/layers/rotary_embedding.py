"""Rotary position embeddings (the rotate-half layout HF Llama/Qwen/Mistral checkpoints use),
with the llama3 and linear frequency scalings."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params.get("low_freq_factor", 1.0)
    high_freq_factor = params.get("high_freq_factor", 4.0)
    old_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The RoPE settings of a HF config, whether it uses ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling`` fields."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling and not params.get("rope_type"):
        params.update(scaling)
    if "rope_type" not in params:
        params["rope_type"] = params.pop("type", "default")
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_size: int,
        max_position: int,
        params: dict[str, Any],
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim or head_size
        base = float(params["rope_theta"])
        inv_freq = 1.0 / (
            base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim)
        )
        rope_type = params["rope_type"]
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type != "default":
            raise NotImplementedError(f"RoPE scaling type {rope_type!r} is not supported yet.")
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.cos_sin_cache: torch.Tensor
        self.register_buffer(
            "cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], -1), persistent=False
        )

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_size)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rot.float().chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
        return torch.cat([out, rest], dim=-1).view(shape)
