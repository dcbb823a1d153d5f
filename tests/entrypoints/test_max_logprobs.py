"""``--max-logprobs`` (vLLM's): the most logprobs one request may ask for, -1 for the whole
vocabulary; a request over the limit is refused naming its field and changes nothing else."""

from __future__ import annotations

import math

import pytest

from pagellm import LLM, SamplingParams
from pagellm.config import ConfigError
from pagellm.engine.args import EngineArgs
from pagellm.sampling_params import DEFAULT_MAX_LOGPROBS, SamplingParamsError


def _params(**fields) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, **fields)


def _engine_is_idle(llm: LLM) -> bool:
    engine = llm.llm_engine
    kv = engine.engine_core.kv_cache_manager
    return not engine.has_unfinished_requests() and (
        kv.num_free_blocks == kv.block_pool.num_blocks - 1
    )


@pytest.fixture(scope="module")
def default_llm(tiny_models):
    return LLM(tiny_models["llama3"], max_model_len=128, kv_cache_memory=16 << 20)


@pytest.fixture(scope="module")
def whole_vocab_llm(tiny_models):
    return LLM(tiny_models["llama3"], max_model_len=128, kv_cache_memory=16 << 20, max_logprobs=-1)


def test_the_default_limit_is_vllms(default_llm):
    assert DEFAULT_MAX_LOGPROBS == 20
    assert default_llm.llm_engine.config.model.max_logprobs == 20
    out = default_llm.generate([[5, 6, 7]], _params(logprobs=20), use_tqdm=False)[0].outputs[0]
    assert all(len(position) in (20, 21) for position in out.logprobs)


@pytest.mark.parametrize(
    ("field", "value"),
    [("logprobs", 21), ("prompt_logprobs", 21), ("logprobs", -1), ("prompt_logprobs", -1)],
)
def test_more_than_the_limit_is_refused_naming_the_field(default_llm, field, value):
    with pytest.raises(SamplingParamsError, match="--max-logprobs") as caught:
        default_llm.generate([[5, 6, 7]], _params(**{field: value}), use_tqdm=False)
    assert caught.value.param == field and f"{field}={value}" in str(caught.value)
    assert _engine_is_idle(default_llm)
    # The engine goes on serving.
    assert (
        len(default_llm.generate([[5, 6]], _params(), use_tqdm=False)[0].outputs[0].token_ids) == 3
    )


def test_minus_one_gives_every_token_of_the_vocabulary(whole_vocab_llm):
    vocab = whole_vocab_llm.llm_engine.config.model.vocab_size
    prompt = [40, 41, 42, 43]
    [output] = whole_vocab_llm.generate(
        [prompt], _params(logprobs=-1, prompt_logprobs=-1), use_tqdm=False
    )
    completion = output.outputs[0]
    assert len(completion.logprobs) == 3
    for token, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert len(position) == vocab
        assert sorted(lp.rank for lp in position.values()) == list(range(1, vocab + 1))
        assert position[token].rank == 1  # greedy
        assert math.isclose(
            sum(math.exp(lp.logprob) for lp in position.values()), 1.0, rel_tol=1e-3
        )
    # The first prompt token has no logprobs; each later one lists the whole vocabulary and its own.
    assert output.prompt_logprobs[0] is None
    for token, position in zip(prompt[1:], output.prompt_logprobs[1:], strict=True):
        assert len(position) == vocab and token in position
    # The same top logprobs as a request that names a count.
    [named] = whole_vocab_llm.generate([prompt], _params(logprobs=5), use_tqdm=False)
    for full, top in zip(completion.logprobs, named.outputs[0].logprobs, strict=True):
        for token, lp in top.items():
            assert lp.rank == full[token].rank
            assert math.isclose(lp.logprob, full[token].logprob, abs_tol=1e-5)


def test_a_lower_limit_refuses_what_it_does_not_allow(tiny_models):
    llm = LLM(tiny_models["llama3"], max_model_len=128, kv_cache_memory=16 << 20, max_logprobs=2)
    with pytest.raises(SamplingParamsError, match="limit of 2"):
        llm.generate([[5, 6, 7]], _params(logprobs=3), use_tqdm=False)
    out = llm.generate([[5, 6, 7]], _params(logprobs=2), use_tqdm=False)[0].outputs[0]
    assert all(len(position) in (2, 3) for position in out.logprobs)
    assert _engine_is_idle(llm)


def test_bad_limits_and_counts_are_refused(tiny_models):
    with pytest.raises(ConfigError, match="--max-logprobs"):
        EngineArgs(model=tiny_models["llama3"], max_logprobs=-2).create_engine_config()
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(SamplingParamsError, match=field):
            SamplingParams(**{field: -2})
