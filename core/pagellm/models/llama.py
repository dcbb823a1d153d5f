"""The Llama family decoder (Llama 2/3, SmolLM2, Mistral; Qwen2 and Qwen3 subclass it).

Projections are fused (qkv, gate_up) for fewer, larger matmuls; `load_weights` maps the HF
checkpoint's separate q/k/v and gate/up tensors into their slices.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagellm.attention import Attention, AttentionBackend
from pagellm.config import EngineConfig
from pagellm.layers.activation import SiluAndMul
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.linear import Linear, VocabEmbedding, load_parameter
from pagellm.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from pagellm.quantization.base import QuantizationConfig


@dataclass(frozen=True)
class LayerContext:
    """What every layer of the model is built with."""

    hf_config: Any
    sliding_window: int | None
    backend: type[AttentionBackend]
    quant_config: QuantizationConfig | None
    rotary_emb: RotaryEmbedding
    qkv_bias: bool
    qk_norm: bool


class LlamaAttention(nn.Module):
    def __init__(self, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        hidden = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_size = getattr(cfg, "head_dim", None) or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        bias = getattr(cfg, "attention_bias", False)
        self.qkv_proj = Linear(
            hidden,
            self.q_size + 2 * self.kv_size,
            bias or ctx.qkv_bias,
            ctx.quant_config,
            f"{prefix}.qkv_proj",
            output_sizes=[self.q_size, self.kv_size, self.kv_size],
        )
        self.o_proj = Linear(self.q_size, hidden, bias, ctx.quant_config, f"{prefix}.o_proj")
        self.qk_norm = ctx.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_size, cfg.rms_norm_eps)
        self.rotary_emb = ctx.rotary_emb
        self.attn = Attention(
            ctx.backend,
            self.num_heads,
            self.head_size,
            self.head_size**-0.5,
            self.num_kv_heads,
            sliding_window=ctx.sliding_window,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            t = q.shape[0]
            q = self.q_norm(q.reshape(t, -1, self.head_size)).reshape(t, -1)
            k = self.k_norm(k.reshape(t, -1, self.head_size)).reshape(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        bias = getattr(cfg, "mlp_bias", False)
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(
            cfg.hidden_size,
            2 * inter,
            bias,
            ctx.quant_config,
            f"{prefix}.gate_up_proj",
            output_sizes=[inter, inter],
        )
        self.down_proj = Linear(
            inter, cfg.hidden_size, bias, ctx.quant_config, f"{prefix}.down_proj"
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.self_attn = LlamaAttention(ctx, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(ctx, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(ctx, f"{prefix}.layers.{i}") for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = ctx.rotary_emb

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        self.rotary_emb.set_positions(positions)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    qkv_bias = False  # bias on q/k/v even when the config says none (Qwen2)
    qk_norm = False  # RMSNorm on each head of q and k, before the rotation (Qwen3)
    # (fused parameter, checkpoint name, shard index)
    stacked_params = (
        ("qkv_proj", "q_proj", 0),
        ("qkv_proj", "k_proj", 1),
        ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(
        self,
        config: EngineConfig,
        attn_backend: type[AttentionBackend],
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        cfg = config.model.text_config
        self.hf_config = cfg
        # One cos/sin table shared by every layer.
        rotary_emb = RotaryEmbedding(
            config.model.head_size, config.model.max_model_len, rope_parameters(cfg)
        )
        ctx = LayerContext(
            cfg,
            config.model.sliding_window,
            attn_backend,
            quant_config,
            rotary_emb,
            self.qkv_bias,
            self.qk_norm,
        )
        self.model = LlamaModel(ctx, "model")
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states @ self.lm_head.weight.t()

    def _shard_sizes(self, fused: str) -> list[int]:
        attn = self.model.layers[0].self_attn
        assert isinstance(attn, LlamaAttention)
        if fused == "qkv_proj":
            return [attn.q_size, attn.kv_size, attn.kv_size]
        inter = self.hf_config.intermediate_size
        return [inter, inter]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into the parameters; returns the parameters set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            for fused, part, shard in self.stacked_params:
                if f".{part}." not in name:
                    continue
                target = name.replace(f".{part}.", f".{fused}.")
                sizes = self._shard_sizes(fused)
                offset = sum(sizes[:shard])
                load_parameter(params[target], tensor, name, shard, (offset, sizes[shard]))
                loaded.add(target)
                break
            else:
                if name not in params:
                    raise ValueError(
                        f"Checkpoint tensor {name!r} matches no parameter of {type(self).__name__}."
                    )
                load_parameter(params[name], tensor, name)
                loaded.add(name)
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is the Llama decoder with a sliding window (read from the config)."""
