"""Rotary position embeddings (the rotate-half layout HF Llama/Qwen/Mistral checkpoints use),
with the llama3 and linear frequency scalings."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagellm.layers.custom_ops import get_custom_op


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
    """Rotates the first and second half of each head (HF's layout). One instance serves every
    layer. With the platform's fused kernel, q and k are rotated in place; otherwise the cos/sin
    rows of a step's positions are looked up once (`set_positions`) and reused by all layers."""

    def __init__(self, head_size: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_size = head_size
        base = float(params["rope_theta"])
        inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size))
        rope_type = params["rope_type"]
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type != "default":
            raise NotImplementedError(f"RoPE scaling type {rope_type!r} is not supported yet.")
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.cos_sin_cache: torch.Tensor
        self.register_buffer(
            "cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], -1), persistent=False
        )
        self._op = get_custom_op("rotary_embedding")
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_positions(self, positions: torch.Tensor) -> None:
        """Called once per forward pass, before the first layer."""
        if self._op is None:
            cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
            self._cos_sin = (cos, sin)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        assert self._cos_sin is not None, "set_positions() must be called first"
        cos, sin = self._cos_sin
        shape, dtype = x.shape, x.dtype
        x1, x2 = x.reshape(shape[0], -1, self.head_size).float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype).view(shape)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` [tokens, heads * head_size], ``k`` [tokens, kv_heads * head_size]."""
        if self._op is not None:
            self._op(positions, q, k, self.head_size, self.cos_sin_cache)
            return q, k
        return self._rotate(q), self._rotate(k)
