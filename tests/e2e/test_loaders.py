"""Weight loaders: sharded safetensors with an index, and dummy weights (GGUF: pagellm-gguf's tests)."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def test_sharded_checkpoint_with_index_loads_like_the_single_file(tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tiny_models["qwen3"]
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(source).save_pretrained(sharded, max_shard_size="100KB")
    AutoTokenizer.from_pretrained(source).save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1

    kwargs = dict(max_model_len=64, kv_cache_memory=4 << 20)
    single = LLM(source, **kwargs).generate(PROMPTS, GREEDY, use_tqdm=False)
    multi = LLM(str(sharded), **kwargs).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in single] == [o.outputs[0].token_ids for o in multi]


def test_missing_shard_named_in_index_is_a_clear_error(tiny_models, tmp_path):
    import json
    import shutil

    target = tmp_path / "broken"
    shutil.copytree(tiny_models["qwen3"], target)
    (target / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        LLM(str(target), max_model_len=64, kv_cache_memory=4 << 20)


def test_dummy_weights_run_any_config_without_a_checkpoint(tiny_models, tmp_path):
    import shutil

    target = tmp_path / "config-only"
    shutil.copytree(tiny_models["mistral"], target, ignore=shutil.ignore_patterns("*.safetensors"))
    llm = LLM(str(target), load_format="dummy", max_model_len=64, kv_cache_memory=4 << 20)
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
