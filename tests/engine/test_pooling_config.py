"""The pooling runner's configuration: which runner a model gets, what it turns off, the pooler a
sentence-transformers checkpoint declares, and non-causal attention (the backends' declaration,
the selector's refusal, TORCH_SDPA's bidirectional prefill)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from pagellm.attention.backend import CommonAttentionMetadata
from pagellm.attention.backends.torch_sdpa import TorchSDPABackend
from pagellm.attention.selector import NoAttentionBackendError, select_attention_backend
from pagellm.config import ConfigError
from pagellm.engine.args import EngineArgs
from pagellm.kv_cache.spec import KVCacheSpec
from pagellm.model_loader.sentence_transformers import read_pooler_config


def _write(directory, name: str, data: object) -> None:
    path = os.path.join(directory, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f)


def _modules(*kinds: str) -> list[dict[str, str]]:
    paths = {"Pooling": "1_Pooling", "Normalize": "2_Normalize", "Dense": "2_Dense"}
    return [
        {
            "idx": i,
            "name": str(i),
            "path": paths.get(k, ""),
            "type": f"sentence_transformers.models.{k}",
        }
        for i, k in enumerate(kinds)
    ]


def test_the_pooler_is_read_from_the_sentence_transformers_modules(tmp_path):
    _write(tmp_path, "modules.json", _modules("Transformer", "Pooling", "Normalize"))
    _write(tmp_path, "1_Pooling/config.json", {"pooling_mode_mean_tokens": True})
    config = read_pooler_config(str(tmp_path), "CLS")
    assert (config.pooling_type, config.normalize) == ("MEAN", True)
    _write(tmp_path, "modules.json", _modules("Transformer", "Pooling"))
    _write(tmp_path, "1_Pooling/config.json", {"pooling_mode": "lasttoken"})
    config = read_pooler_config(str(tmp_path), "CLS")
    assert (config.pooling_type, config.normalize) == ("LAST", False)
    _write(tmp_path, "1_Pooling/config.json", {"pooling_mode_max_tokens": True})
    with pytest.raises(ConfigError, match=r"pooling \['max'\]"):
        read_pooler_config(str(tmp_path), "CLS")
    _write(tmp_path, "modules.json", _modules("Transformer", "Pooling", "Dense"))
    _write(tmp_path, "1_Pooling/config.json", {"pooling_mode_cls_token": True})
    with pytest.raises(ConfigError, match="Dense"):
        read_pooler_config(str(tmp_path), "MEAN")
    os.remove(tmp_path / "modules.json")  # not a sentence-transformers checkpoint: the default
    config = read_pooler_config(str(tmp_path), "CLS")
    assert (config.pooling_type, config.normalize) == ("CLS", True)


def test_bert_gets_the_pooling_runner_without_chunked_prefill_or_prefix_caching(minilm_path):
    config = EngineArgs(minilm_path).create_engine_config()
    model = config.model
    assert (model.runner, model.tasks, model.is_causal) == ("pooling", frozenset({"embed"}), False)
    assert model.pooler is not None
    assert (model.pooler.pooling_type, model.pooler.normalize) == ("MEAN", True)
    assert not config.scheduler.enable_chunked_prefill
    assert not config.cache.enable_prefix_caching
    assert config.scheduler.max_num_batched_tokens >= model.max_model_len == 512
    assert config.compilation.enforce_eager  # no decode graphs: it never decodes
    assert EngineArgs(minilm_path, task="embed").create_engine_config().model.runner == "pooling"


def test_runners_a_model_cannot_run_are_refused(minilm_path, tiny_models):
    with pytest.raises(ConfigError, match="BertModel cannot generate text"):
        EngineArgs(minilm_path, runner="generate").create_engine_config()
    with pytest.raises(ConfigError, match="pass only one of them"):
        EngineArgs(minilm_path, task="embed", runner="generate").create_engine_config()
    with pytest.raises(ConfigError, match="long_prefill_token_threshold"):
        EngineArgs(minilm_path, long_prefill_token_threshold=64).create_engine_config()
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM cannot pool .* runner 'generate'"):
        EngineArgs(tiny_models["llama3"], runner="pooling").create_engine_config()
    generate = EngineArgs(tiny_models["llama3"]).create_engine_config().model
    assert (generate.runner, generate.tasks, generate.pooler) == (
        "generate",
        frozenset({"generate"}),
        None,
    )


def test_the_selector_refuses_a_backend_without_non_causal_attention(monkeypatch):
    query = dict(
        requested="TORCH_SDPA",
        ranking=["TORCH_SDPA"],
        device_type="cpu",
        head_size=32,
        dtype=torch.float32,
        block_size=None,
        sliding_window=None,
    )
    assert select_attention_backend(**query, causal=False) is TorchSDPABackend
    monkeypatch.setattr(TorchSDPABackend, "supports_non_causal", False)
    assert select_attention_backend(**query) is TorchSDPABackend  # causal models still fit
    with pytest.raises(NoAttentionBackendError, match="non-causal .* not supported"):
        select_attention_backend(**query, causal=False)


def test_torch_sdpa_attends_bidirectionally_over_whole_prompts():
    heads, head_size, block_size, lens = 2, 8, 4, [5, 3]
    spec = KVCacheSpec(block_size, heads, head_size, torch.float32)
    impl = TorchSDPABackend.get_impl_cls()(heads, head_size, head_size**-0.5, heads, None)
    impl.causal = False
    cache = torch.zeros(TorchSDPABackend.get_kv_cache_shape(8, block_size, heads, head_size))
    tokens = sum(lens)
    qsl = torch.tensor([0, 5, 8], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    block_table = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    slots = torch.tensor([4, 5, 6, 7, 8, 12, 13, 14])
    common = CommonAttentionMetadata(
        2, tokens, 5, 5, qsl, qsl, seq_lens, seq_lens, block_table, slots
    )
    builder = TorchSDPABackend.get_builder_cls()(spec, torch.device("cpu"))
    torch.manual_seed(0)
    q, k, v = (torch.randn(tokens, heads * head_size) for _ in range(3))
    out = impl.forward(q, k, v, cache, builder.build(common))
    for start, end in ((0, 5), (5, 8)):  # each prompt sees all of itself, nothing of the other
        shaped = [
            t[start:end].view(end - start, heads, head_size).transpose(0, 1) for t in (q, k, v)
        ]
        expected = F.scaled_dot_product_attention(*shaped).transpose(0, 1).reshape(end - start, -1)
        torch.testing.assert_close(out[start:end], expected)
    chunk_qsl = torch.tensor([0, 2], dtype=torch.int32)  # the first prompt's last 2 tokens
    chunk = CommonAttentionMetadata(
        1, 2, 2, 5, chunk_qsl, chunk_qsl, seq_lens[:1], seq_lens[:1], block_table[:1], slots[3:5]
    )
    with pytest.raises(RuntimeError, match="not whole"):
        impl.forward(q[:2], k[:2], v[:2], cache, builder.build(chunk))
