"""The Llama family decoder (Llama 2/3, SmolLM2, Mistral; Qwen2 and Qwen3 subclass it).

Projections are fused (qkv, gate_up) for fewer, larger matmuls; `load_weights` maps the HF
checkpoint's separate q/k/v and gate/up tensors into their slices. Under tensor parallelism
(`get_tp_group` with several ranks) qkv and gate_up are column-parallel, o_proj and down_proj
row-parallel (one all-reduce each per layer), and each rank's attention runs its share of the
heads; the embedding and the LM head are replicated.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from pagellm.attention import Attention, AttentionBackend
from pagellm.config import EngineConfig
from pagellm.layers.activation import SiluAndMul
from pagellm.layers.custom_ops import get_custom_op
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.linear import (
    CheckpointTensor,
    Linear,
    VocabEmbedding,
    load_parameter,
    materialize,
)
from pagellm.layers.parallel_linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagellm.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from pagellm.models.segments import AttentionInputs, SegmentedDecoder
from pagellm.quantization.base import QuantizationConfig, QuantizedActivation


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
        total_heads = cfg.num_attention_heads
        total_kv_heads = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.head_size = getattr(cfg, "head_dim", None) or hidden // total_heads
        bias = getattr(cfg, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(
            hidden,
            self.head_size,
            total_heads,
            total_kv_heads,
            bias or ctx.qkv_bias,
            ctx.quant_config,
            f"{prefix}.qkv_proj",
        )
        # This rank's heads (all of them with one rank).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self.o_proj = RowParallelLinear(
            total_heads * self.head_size, hidden, bias, ctx.quant_config, f"{prefix}.o_proj"
        )
        self.qk_norm = ctx.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_size, cfg.rms_norm_eps)
        # The platform's kernel for both per-head norms and the rotation (one launch, not three).
        self._qk_norm_rotary_op = get_custom_op("qk_norm_rotary") if self.qk_norm else None
        self.rotary_emb = ctx.rotary_emb
        self.attn = Attention(
            ctx.backend,
            self.num_heads,
            self.head_size,
            self.head_size**-0.5,
            self.num_kv_heads,
            sliding_window=ctx.sliding_window,
        )

    def project_qkv(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | QuantizedActivation,
        qkv_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention's inputs: q, k and v of each token, q and k normed (Qwen3) and rotated;
        the projection written into ``qkv_out`` when given (`Linear.forward_into`)."""
        if qkv_out is None:
            qkv = self.qkv_proj(hidden_states)
        else:
            qkv = self.qkv_proj.forward_into(hidden_states, qkv_out)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self._qk_norm_rotary_op is not None:  # q and k, views of qkv, written in place
            self._qk_norm_rotary_op(
                positions,
                q,
                k,
                self.q_norm.weight,
                self.k_norm.weight,
                self.q_norm.eps,
                self.head_size,
                self.rotary_emb.cos_sin_cache,
            )
        else:
            if self.qk_norm:
                t = q.shape[0]
                q = self.q_norm(q.reshape(t, -1, self.head_size)).reshape(t, -1)
                k = self.k_norm(k.reshape(t, -1, self.head_size)).reshape(t, -1)
            q, k = self.rotary_emb(positions, q, k)
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(self, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        bias = getattr(cfg, "mlp_bias", False)
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [inter, inter], bias, ctx.quant_config, f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            inter, cfg.hidden_size, bias, ctx.quant_config, f"{prefix}.down_proj"
        )
        self.act_fn = SiluAndMul()
        self.act_fn.feeds(self.down_proj)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.self_attn = LlamaAttention(ctx, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(ctx, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Each norm's output is one projection's input: a quantization method may quantize it
        # in the norm's kernel (`pagellm.layers.input_producer`), as the MLP's activation does.
        self.input_layernorm.feeds(self.self_attn.qkv_proj)
        self.post_attention_layernorm.feeds(self.mlp.gate_up_proj)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = self.pre_attention(positions, hidden_states, residual)
        attn_output = self.self_attn.attn(inputs.q, inputs.k, inputs.v)
        return self.post_attention(attn_output, inputs.residual)

    def pre_attention(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        qkv_out: torch.Tensor | None = None,
    ) -> AttentionInputs:
        """The layer up to its attention call: the residual add (``residual`` None: the first
        layer, whose input is the residual stream), the norm, q, k and v (their projection
        written into ``qkv_out`` when given)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        q, k, v = self.self_attn.project_qkv(positions, hidden_states, qkv_out)
        return AttentionInputs(q, k, v, residual)

    def post_attention(
        self, attn_output: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after its attention call: the output projection, the residual add and
        norm, the MLP; returns the MLP's output and the residual stream (the next layer adds
        them)."""
        hidden_states = self.self_attn.o_proj(attn_output)
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

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``inputs_embeds``: the step's input embeddings, when some are not the tokens' (a
        multimodal model's item embeddings); else the tokens' are looked up."""
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        self.rotary_emb.set_positions(positions)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    # The forward pass in segments split at each attention call (`SegmentedDecoder`): the same
    # layer code, in the same order; each segment looks up the rotary rows itself, so that it
    # reads nothing another segment computed but its arguments.

    def _layer(self, index: int) -> LlamaDecoderLayer:
        return cast(LlamaDecoderLayer, self.layers[index])

    def attention_layers(self) -> list[Attention]:
        return [self._layer(i).self_attn.attn for i in range(len(self.layers))]

    def first_segment(
        self, input_ids: torch.Tensor, positions: torch.Tensor, qkv_out: torch.Tensor | None = None
    ) -> AttentionInputs:
        self.rotary_emb.set_positions(positions)
        embeds = self.embed_tokens(input_ids)
        return self._layer(0).pre_attention(positions, embeds, None, qkv_out)

    def next_segment(
        self,
        index: int,
        positions: torch.Tensor,
        attn_output: torch.Tensor,
        residual: torch.Tensor,
        qkv_out: torch.Tensor | None = None,
    ) -> AttentionInputs:
        self.rotary_emb.set_positions(positions)
        hidden_states, residual = self._layer(index - 1).post_attention(attn_output, residual)
        return self._layer(index).pre_attention(positions, hidden_states, residual, qkv_out)

    def last_segment(self, attn_output: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self._layer(-1).post_attention(attn_output, residual)
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

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def segmented_decoder(self) -> SegmentedDecoder:
        """The forward pass split at each attention call, for piecewise graphs."""
        return self.model

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states @ self.lm_head.weight.t()

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names; lazy slices under tensor parallelism, of which a
        linear layer reads only its rank's part) into the parameters; returns the parameters
        set."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            target, shard = name, None
            for fused, part, index in self.stacked_params:
                if f".{part}." in name:
                    target, shard = name.replace(f".{part}.", f".{fused}."), index
                    break
            if target not in params:
                raise ValueError(
                    f"Checkpoint tensor {name!r} matches no parameter of {type(self).__name__}."
                )
            module_name, _, param_name = target.rpartition(".")
            module = modules[module_name]
            if isinstance(module, Linear):
                module.load_checkpoint_tensor(param_name, tensor, name, shard)
            else:
                load_parameter(params[target], materialize(tensor), name)
            loaded.add(target)
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is the Llama decoder with a sliding window (read from the config)."""
