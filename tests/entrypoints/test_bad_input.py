"""Bad input raises a clear ValueError naming the field, and leaves the engine usable."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.sampling_params import SamplingParamsError

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["qwen2"], max_model_len=64, kv_cache_memory=4 << 20)


def assert_engine_clean_and_usable(llm):
    core = llm.llm_engine.engine_core
    kv = core.kv_cache_manager
    assert not core.has_unfinished_requests()
    assert not llm.llm_engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.block_pool.num_blocks - 1
    out = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        ("", "prompt"),
        ([], "prompt"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ([5] * 64, "max_model_len"),
        ([5] * 200, "max_model_len"),
        ([5, 1024, 6], "prompt_token_ids"),
        ([5, -1, 6], "prompt_token_ids"),
        ([5, True, 6], "prompt_token_ids"),
        ([5, 6.0, 7], "prompt_token_ids"),
        ([5, "6", 7], "prompt_token_ids"),
        # The tiny model has 1024 tokens but SmolLM2's tokenizer: this text tokenizes past them.
        ("The capital of France is Paris", "vocabulary"),
    ],
)
def test_bad_prompt_is_refused_and_engine_stays_usable(llm, prompt, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([[1, 2, 3], prompt], GREEDY, use_tqdm=False)  # the good one must not be queued
    assert_engine_clean_and_usable(llm)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -2}, "top_k"),
    ],
)
def test_bad_sampling_params_raise_value_error_naming_the_field(llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
    assert_engine_clean_and_usable(llm)


def test_missing_model_path_names_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="model=.*no-such-model.*does not exist"):
        LLM(str(missing))


def test_unknown_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["FancyNewForCausalLM"], "model_type": "llama"}'
    )
    with pytest.raises(ValueError, match="FancyNewForCausalLM"):
        LLM(str(tmp_path))


def test_directory_without_weights_is_a_clear_error(tiny_models, tmp_path):
    import shutil

    target = tmp_path / "no-weights"
    shutil.copytree(tiny_models["qwen2"], target, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(target), max_model_len=64, kv_cache_memory=4 << 20)


def test_kv_cache_too_small_for_one_request_is_a_clear_error(tiny_models):
    with pytest.raises(ValueError, match="max_model_len=64"):
        LLM(tiny_models["qwen2"], max_model_len=64, kv_cache_memory=2048)


def test_mismatched_sampling_params_list_is_refused(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[1, 2], [3, 4]], [GREEDY], use_tqdm=False)
    assert_engine_clean_and_usable(llm)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**63 - 1, "n": 2}, "seed"),
        ({"top_k": 2**63}, "top_k"),
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"min_tokens": 2**64, "max_tokens": None}, "min_tokens"),
        ({"n": 2**64}, "n"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"logit_bias": {2**64: 1.0}}, "logit_bias"),
    ],
)
def test_integers_beyond_the_wire_range_are_refused_naming_the_field(kwargs, param):
    from pagellm.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError, match=param) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [({"stop": ""}, "stop"), ({"stop": ["a", ""]}, "stop"), ({"bad_words": [""]}, "bad_words")],
)
def test_empty_stop_strings_and_bad_words_are_refused(kwargs, param):
    """An empty stop string would stop at once; an empty bad word would ban the space token
    (what follows a space)."""
    with pytest.raises(SamplingParamsError, match=f"{param} must be non-empty strings") as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_top_k_beyond_the_vocabulary_is_no_top_k_and_the_engine_lives(llm):
    # Used to index past the vocabulary in the sampler's gather and kill the engine.
    params = SamplingParams(temperature=1.0, top_k=100_000, seed=1, max_tokens=4, ignore_eos=True)
    [out] = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    assert_engine_clean_and_usable(llm)


def test_stop_token_ids_outside_the_vocabulary_and_bad_priority_are_refused(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[5, 6]], SamplingParams(stop_token_ids=[5000]), use_tqdm=False)
    with pytest.raises(ValueError, match="priority"):
        llm.llm_engine.add_request("p", [5, 6], GREEDY, priority=2**63)
    # Under first come, first served a priority would be ignored: refused, naming it.
    with pytest.raises(SamplingParamsError, match="does not order by priority") as refused:
        llm.generate([[5, 6]], GREEDY, priority=[3], use_tqdm=False)
    assert refused.value.param == "priority"
    assert_engine_clean_and_usable(llm)
