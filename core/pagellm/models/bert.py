"""BERT encoders for embeddings (`BertModel`: all-MiniLM-L6-v2 and other sentence-transformers
checkpoints): bidirectional attention over each prompt, post-LayerNorm residual blocks, learned
absolute positions, and a `Pooler` (mean, CLS or last token) instead of an LM head.

The pooling runner runs it (``runners``): one forward over each whole prompt, no sampling. The
attention layers are non-causal, so the selector picks a backend that declares
``supports_non_causal``. Under tensor parallelism q/k/v and the intermediate projection are
column-parallel and the two output projections row-parallel, as in the Llama decoder; the
embedding tables are replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention import Attention, AttentionBackend
from pagellm.config import EngineConfig, PoolingType, Runner
from pagellm.layers.linear import (
    CheckpointTensor,
    Linear,
    VocabEmbedding,
    load_parameter,
    materialize,
)
from pagellm.layers.parallel_linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagellm.layers.pooler import Pooler
from pagellm.quantization.base import QuantizationConfig

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class BertOutput(nn.Module):
    """A projection back to the hidden size, added to the block's input, then LayerNorm."""

    def __init__(self, cfg: Any, in_features: int, quant: QuantizationConfig | None, prefix: str):
        super().__init__()
        self.dense = RowParallelLinear(in_features, cfg.hidden_size, True, quant, f"{prefix}.dense")
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(
        self,
        cfg: Any,
        backend: type[AttentionBackend],
        quant: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        hidden, heads = cfg.hidden_size, cfg.num_attention_heads
        head_size = hidden // heads
        self.qkv_proj = QKVParallelLinear(
            hidden, head_size, heads, heads, True, quant, f"{prefix}.qkv_proj"
        )
        self.size = self.qkv_proj.num_heads * head_size  # this rank's heads
        num_heads = self.qkv_proj.num_heads
        self.attn = Attention(
            backend, num_heads, head_size, head_size**-0.5, num_heads, causal=False
        )
        self.output = BertOutput(cfg, hidden, quant, f"{prefix}.output")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.size] * 3, dim=-1)
        return self.output(self.attn(q, k, v), hidden_states)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: Any, quant: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(
            cfg.hidden_size, cfg.intermediate_size, True, quant, f"{prefix}.dense"
        )


class BertLayer(nn.Module):
    def __init__(
        self,
        cfg: Any,
        backend: type[AttentionBackend],
        quant: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(
                f"BERT hidden_act {act!r} is not supported; supported: {sorted(_ACTIVATIONS)}."
            )
        self.act = _ACTIVATIONS[act]
        self.attention = BertAttention(cfg, backend, quant, f"{prefix}.attention")
        self.intermediate = BertIntermediate(cfg, quant, f"{prefix}.intermediate")
        self.output = BertOutput(cfg, cfg.intermediate_size, quant, f"{prefix}.output")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        attended = self.attention(hidden_states)
        return self.output(self.act(self.intermediate.dense(attended)), attended)


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        kind = getattr(cfg, "position_embedding_type", "absolute")
        if kind != "absolute":
            raise NotImplementedError(
                f"BERT position_embedding_type {kind!r} is not supported (only 'absolute')."
            )
        self.word_embeddings = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = VocabEmbedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = VocabEmbedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # One segment per prompt: every token has token type 0.
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])


class BertEncoder(nn.Module):
    def __init__(
        self, cfg: Any, backend: type[AttentionBackend], quant: QuantizationConfig | None
    ) -> None:
        super().__init__()
        self.layer = nn.ModuleList(
            BertLayer(cfg, backend, quant, f"encoder.layer.{i}")
            for i in range(cfg.num_hidden_layers)
        )


class BertModel(nn.Module):
    runners: ClassVar[tuple[Runner, ...]] = ("pooling",)
    is_causal: ClassVar[bool] = False
    default_pooling_type: ClassVar[PoolingType] = "CLS"
    """Without a sentence-transformers config, BERT embeds with its [CLS] token (as vLLM does)."""

    def __init__(
        self,
        config: EngineConfig,
        attn_backend: type[AttentionBackend],
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        cfg = config.model.text_config
        if config.model.pooler is None:
            raise ValueError("BertModel runs with the pooling runner (it has no LM head).")
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg, attn_backend, quant_config)
        self.pooler = Pooler(config.model.pooler)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embeddings(input_ids, positions)
        layer: BertLayer
        for layer in self.encoder.layer:  # type: ignore[assignment]
            hidden_states = layer(hidden_states)
        return hidden_states

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """HF names; q/k/v go into the fused ``qkv_proj``. The checkpoint's ``pooler`` (a tanh
        layer over [CLS] that sentence-transformers does not use) and its ``position_ids``
        buffer are skipped."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("pooler.") or name.endswith("position_ids"):
                continue
            target, shard = name, None
            for index, part in enumerate(("query", "key", "value")):
                if f".self.{part}." in name:
                    target, shard = name.replace(f".self.{part}.", ".qkv_proj."), index
            # Early BERT checkpoints name LayerNorm's parameters gamma and beta.
            target = target.replace("LayerNorm.gamma", "LayerNorm.weight")
            target = target.replace("LayerNorm.beta", "LayerNorm.bias")
            if target not in params:
                raise ValueError(f"Checkpoint tensor {name!r} matches no parameter of BertModel.")
            module_name, _, param_name = target.rpartition(".")
            module = modules[module_name]
            if isinstance(module, Linear):
                module.load_checkpoint_tensor(param_name, tensor, name, shard)
            else:
                load_parameter(params[target], materialize(tensor), name)
            loaded.add(target)
        return loaded
