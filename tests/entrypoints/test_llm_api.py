"""The offline API: prompt forms, per-prompt parameters, outputs, seeded sampling, stops, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pagellm import LLM, CompletionOutput, RequestOutput, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama3"], max_model_len=128, kv_cache_memory=16 << 20)


def test_prompts_as_text_token_ids_and_dicts_give_ordered_outputs(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("in the of and to")
    outputs = llm.generate(
        ["in the of and to", ids, {"prompt_token_ids": ids}, {"prompt": "in the of and to"}],
        GREEDY,
        use_tqdm=False,
    )
    assert [o.request_id for o in outputs] == sorted((o.request_id for o in outputs), key=int)
    first = outputs[0]
    assert isinstance(first, RequestOutput) and isinstance(first.outputs[0], CompletionOutput)
    assert first.prompt == "in the of and to" and first.prompt_token_ids == ids and first.finished
    assert outputs[1].prompt is None
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    completion = first.outputs[0]
    assert (
        completion.index == 0
        and completion.finish_reason == "length"
        and completion.stop_reason is None
    )
    assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert completion.cumulative_logprob is None and completion.logprobs is None


def test_single_token_id_prompt_and_per_prompt_params(llm):
    outputs = llm.generate(
        [[5, 6, 7], [8, 9]],
        [
            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 5]
    single = llm.generate(
        [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert single[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([[10, 11, 12]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    batch = llm.generate(
        [[3, 4, 5, 6], [10, 11, 12], [7, 8]], [others, seeded, others], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone
    different = llm.generate(
        [[10, 11, 12]],
        SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    assert different[0].outputs[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate(
        [[20, 21, 22]],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    top_k = llm.generate(
        [[20, 21, 22]],
        SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    top_p = llm.generate(
        [[20, 21, 22]],
        SamplingParams(temperature=1.5, top_p=1e-6, seed=3, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    assert (
        greedy[0].outputs[0].token_ids
        == top_k[0].outputs[0].token_ids
        == top_p[0].outputs[0].token_ids
    )


def test_stop_token_ids_and_eos_end_the_request(llm):
    free = llm.generate(
        [[30, 31]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    tokens = free[0].outputs[0].token_ids
    stop_at = tokens[4]
    first = tokens.index(stop_at)
    stopped = llm.generate(
        [[30, 31]],
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.token_ids == tokens[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at

    # The same token as the tokenizer's EOS: stops unless ignore_eos.
    engine = llm.llm_engine
    saved = engine.processor.eos_token_id
    engine.processor.eos_token_id = stop_at
    try:
        eos = llm.generate(
            [[30, 31]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
        )[0].outputs[0]
    finally:
        engine.processor.eos_token_id = saved
    assert (
        eos.token_ids == tokens[: first + 1]
        and eos.finish_reason == "stop"
        and eos.stop_reason is None
    )


def test_max_tokens_default_fills_the_context(llm):
    out = llm.generate(
        [[5] * 120], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 8 and out[0].outputs[0].finish_reason == "length"


def test_logprobs_match_log_softmax_of_hf_logits(llm, tiny_models):
    from transformers import AutoModelForCausalLM

    prompt = [40, 41, 42, 43]
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.logprobs) == 4
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama3"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0]
    ref = logits.log_softmax(-1)
    total = 0.0
    for i, (token, position) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert position[token].rank == 1  # greedy picks the top token
        assert math.isclose(position[token].logprob, row[token].item(), abs_tol=1e-4)
        top = row.topk(3)
        assert set(position) == set(top.indices.tolist())
        for tok, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert math.isclose(position[tok].logprob, lp, abs_tol=1e-4)
        total += row[token].item()
    assert math.isclose(out.cumulative_logprob, total, abs_tol=1e-3)


@pytest.fixture(scope="module")
def one_at_a_time(tiny_models):
    """An engine that runs one sequence at a time, by priority."""
    return LLM(
        tiny_models["llama3"],
        max_model_len=128,
        kv_cache_memory=16 << 20,
        max_num_seqs=1,
        scheduling_policy="priority",
    )


def test_priority_policy_runs_high_priority_first(one_at_a_time):
    engine = one_at_a_time.llm_engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("low", [5, 6], params, priority=5)
    engine.add_request("high", [5, 6], params, priority=-1)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["high", "low"]


def test_abort_frees_blocks(llm):
    engine = llm.llm_engine
    engine.add_request(
        "to-abort", [5] * 40, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    )
    engine.step()
    kv = engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks < kv.block_pool.num_blocks - 1
    aborted = engine.abort_request("to-abort")
    assert aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    assert kv.num_free_blocks == kv.block_pool.num_blocks - 1
    assert not engine.has_unfinished_requests()


def test_skip_tokenizer_init_takes_token_ids_and_returns_no_text(tiny_models, llm):
    no_tok = LLM(tiny_models["llama3"], skip_tokenizer_init=True, kv_cache_memory=1 << 24)
    assert no_tok.get_tokenizer() is None
    params = SamplingParams(temperature=0.0, max_tokens=6)
    prompt = {"prompt_token_ids": [5, 17, 300, 9]}
    out = no_tok.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.text == ""
    # Same tokens as the engine with a tokenizer.
    assert out.token_ids == llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="no tokenizer"):
        no_tok.generate("Hello", params, use_tqdm=False)
    with pytest.raises(ValueError, match="need a tokenizer"):
        no_tok.generate(prompt, SamplingParams(stop=["x"]), use_tqdm=False)


def test_generate_hands_priority_and_cache_salt_to_the_engine(one_at_a_time):
    """The request that runs second finds the first one's prompt in the prefix cache, unless
    their salts differ."""
    prompt = list(range(5, 69))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    low, high = one_at_a_time.generate([prompt, prompt], params, priority=[5, -1], use_tqdm=False)
    assert high.num_cached_tokens == 0 < low.num_cached_tokens  # high ran first
    salted = [{"prompt_token_ids": list(range(100, 164)), "cache_salt": s} for s in "aba"]
    outputs = one_at_a_time.generate(salted, params, use_tqdm=False)
    assert [o.num_cached_tokens > 0 for o in outputs] == [False, False, True]
    with pytest.raises(ValueError, match="cache_salt"):
        one_at_a_time.generate({"prompt_token_ids": prompt, "cache_salt": 7}, use_tqdm=False)


def test_each_prompt_is_tokenized_once(llm, monkeypatch):
    tokenizer = llm.get_tokenizer()
    encode, encoded = tokenizer.encode, []

    def counting_encode(text, *args, **kwargs):
        encoded.append(text)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", counting_encode)
    llm.generate(["in the of", "and to"], GREEDY, use_tqdm=False)
    assert encoded == ["in the of", "and to"]


def test_an_unknown_engine_argument_is_a_type_error_naming_it(tiny_models):
    with pytest.raises(TypeError, match="max_model_length.*max_model_len"):
        LLM(tiny_models["llama3"], max_model_length=128)
