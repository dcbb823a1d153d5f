"""The sampling surface: penalties and bias by hand, masks over many samples, logprobs against HF,
n > 1, stop strings with streaming, min_tokens."""

from __future__ import annotations

import math

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.layers.sampler import (
    Penalties,
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_top_k_top_p,
    process_logits,
)
from pagellm.sampling_params import RequestOutputKind


def metadata(n: int, **kwargs) -> SamplingMetadata:
    base = dict(
        temperature=torch.zeros(n),
        all_greedy=True,
        all_random=False,
        top_p=None,
        top_k=None,
        min_p=None,
        generators={},
        default_generator=torch.Generator(),
        max_num_logprobs=None,
    )
    return SamplingMetadata(**{**base, **kwargs})


def test_penalties_match_a_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    counts = torch.tensor([[2.0, 1.0, 0.0, 0.0]])  # token 0 twice, token 1 once in the output
    prompt = torch.tensor([[False, False, False, True]])  # token 3 in the prompt
    p = Penalties(
        presence=torch.tensor([0.5]),
        frequency=torch.tensor([0.25]),
        repetition=torch.tensor([2.0]),
        output_counts=counts,
        prompt_mask=prompt,
    )
    out = process_logits(logits.clone(), metadata(1, penalties=p))
    # Repetition (seen: 0, 1, 3): positive / 2, negative * 2; then - 0.25 * count - 0.5 * (count > 0).
    expected = [2.0 / 2 - 0.25 * 2 - 0.5, -1.0 * 2 - 0.25 - 0.5, 0.5, 3.0 / 2]
    assert out[0].tolist() == pytest.approx(expected)


def test_logit_bias_allowed_and_banned_tokens_by_hand():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]])
    md = metadata(
        2,
        logit_bias=(torch.tensor([0, 1]), torch.tensor([0, 2]), torch.tensor([10.0, -5.0])),
        allowed_mask=torch.tensor([[True, True, True, False], [True, True, True, True]]),
        banned=(torch.tensor([1]), torch.tensor([1])),
    )
    out = process_logits(logits.clone(), md)
    assert out[0].tolist() == [11.0, 2.0, 3.0, float("-inf")]
    assert out[1].tolist() == [0.0, float("-inf"), -5.0, 0.0]


def test_min_p_top_k_top_p_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda t: (t[0] > float("-inf")).tolist()  # noqa: E731
    assert kept(apply_min_p(logits, torch.tensor([0.2]))) == [True, True, True, False]  # 0.05 < 0.1
    assert kept(apply_top_k_top_p(logits, torch.tensor([2]), None)) == [True, True, False, False]
    assert kept(apply_top_k_top_p(logits, None, torch.tensor([0.8]))) == [True, True, False, False]
    assert kept(apply_top_k_top_p(logits, None, torch.tensor([0.81]))) == [True, True, True, False]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama3"], max_model_len=128, kv_cache_memory=16 << 20)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_argmax_in_the_model_dtype_equals_the_float32_path(dtype):
    """All-greedy batches without logprobs, masks, bias or penalties take the argmax of the
    model-dtype logits; ties (many in bf16) resolve to the first maximum, as in float32."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 1000, generator=gen) * 3).to(dtype)
    logits[5, [3, 700]] = logits[5].max() + 1  # an exact tie: the first one wins
    fast = Sampler()(logits, metadata(64)).sampled_token_ids
    assert fast.tolist() == logits.float().argmax(dim=-1).tolist()
    assert fast[5].item() == 3
    # With a bias the float32 path runs, and the bias counts.
    md = metadata(64, logit_bias=(torch.tensor([5]), torch.tensor([700]), torch.tensor([1.0])))
    assert Sampler()(logits, md).sampled_token_ids[5].item() == 700


def test_allowed_token_ids_and_bad_words_never_violated_over_many_samples(llm):
    allowed = [11, 12, 13, 14, 15]
    params = [
        SamplingParams(
            temperature=1.5, seed=s, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed
        )
        for s in range(20)
    ]
    for out in llm.generate([[5, 6, 7]] * 20, params, use_tqdm=False):
        assert set(out.outputs[0].token_ids) <= set(allowed)

    tokenizer = llm.get_tokenizer()
    free = llm.generate(
        [[5, 6, 7]] * 20,
        [
            SamplingParams(temperature=1.2, seed=s, max_tokens=16, ignore_eos=True)
            for s in range(20)
        ],
        use_tqdm=False,
    )
    counts = {t: sum(o.outputs[0].token_ids.count(t) for o in free) for t in range(3, 1024)}
    processor = llm.llm_engine.processor

    def single_token_bans(token: int) -> set[int]:
        sequences = processor._bad_words_token_ids([tokenizer.decode([token])])
        return {seq[0] for seq in sequences if len(seq) == 1}

    # The most frequent sampled token that is a word of its own (its text tokenizes back to it).
    common = next(
        t for t in sorted(counts, key=counts.get, reverse=True) if t in single_token_bans(t)
    )
    assert counts[common] > 0
    word = tokenizer.decode([common])
    single = single_token_bans(common)
    params = [
        SamplingParams(temperature=1.2, seed=s, max_tokens=16, ignore_eos=True, bad_words=[word])
        for s in range(20)
    ]
    for out in llm.generate([[5, 6, 7]] * 20, params, use_tqdm=False):
        assert not single & set(out.outputs[0].token_ids)


def test_sampled_and_prompt_logprobs_equal_hf_log_softmax(llm, tiny_models):
    from transformers import AutoModelForCausalLM

    prompt = [40, 41, 42, 43, 44, 45]
    params = SamplingParams(
        temperature=1.0, seed=7, max_tokens=6, logprobs=2, prompt_logprobs=2, ignore_eos=True
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama3"], dtype=torch.float32).eval()
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)
    for i, (token, position) in enumerate(zip(tokens, out.outputs[0].logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert math.isclose(position[token].logprob, row[token].item(), abs_tol=1e-4)
        assert position[token].rank == int((row > row[token]).sum()) + 1
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        position = out.prompt_logprobs[i]
        row = ref[i - 1]
        assert math.isclose(position[prompt[i]].logprob, row[prompt[i]].item(), abs_tol=1e-4)
        top = row.topk(2)
        for tok, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert math.isclose(position[tok].logprob, lp, abs_tol=1e-4)


def test_seeded_n4_is_identical_alone_and_inside_a_batch(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[9, 8, 7, 6, 5, 4, 3] * 4], params, use_tqdm=False)[0]
    assert [c.index for c in alone.outputs] == [0, 1, 2, 3]
    completions = [c.token_ids for c in alone.outputs]
    assert len({tuple(c) for c in completions}) > 1  # different seeds per completion
    other = SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True)
    batch = llm.generate(
        [[1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3] * 4, [5] * 30], [other, params, other], use_tqdm=False
    )
    assert [c.token_ids for c in batch[1].outputs] == completions


def test_n_completions_share_the_prompt_blocks_through_the_prefix_cache(llm):
    stats = llm.llm_engine.engine_core.kv_cache_manager.prefix_cache_stats
    before = stats.hits
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks
    llm.generate(
        [prompt], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4), use_tqdm=False
    )
    assert stats.hits - before >= 2 * 48  # completions 2 and 3 reuse completion 1's three blocks


def stream(llm, prompt, params):
    engine = llm.llm_engine
    params = SamplingParams(
        **{
            **{f: getattr(params, f) for f in params.__struct_fields__},
            "output_kind": RequestOutputKind.DELTA,
        }
    )
    engine.add_request("stream", prompt, params)
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                deltas.append(c.text)
            if out.finished:
                final = out
    return deltas, final


def test_stop_string_spanning_two_tokens_and_streamed_deltas_equal_final_text(llm):
    greedy = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, skip_special_tokens=False
    )
    full = llm.generate([[30, 31, 32]], greedy, use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    pieces = [tokenizer.decode([t]) for t in full.token_ids]
    # A stop string made of the end of token 5 and the start of token 6.
    k = next(i for i in range(4, 20) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    text_before = "".join(pieces[: k + 1])[:-2]
    assert full.text.find(stop) == len(text_before)
    params = SamplingParams(
        temperature=0,
        max_tokens=24,
        ignore_eos=True,
        skip_special_tokens=False,
        stop=[stop, "never-matches-this"],
    )
    out = llm.generate([[30, 31, 32]], params, use_tqdm=False)[0].outputs[0]
    assert out.text == text_before and out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[: k + 2]
    included = llm.generate(
        [[30, 31, 32]],
        SamplingParams(
            **{
                **{f: getattr(params, f) for f in params.__struct_fields__},
                "include_stop_str_in_output": True,
            }
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert included.text == text_before + stop

    deltas, final = stream(llm, [30, 31, 32], params)
    # Deltas are never taken back, so their concatenation equal to the cut text means no delta
    # ever carried the start of the stop string while it was still being generated.
    assert "".join(deltas) == text_before
    assert final.finished and final.outputs[0].stop_reason == stop
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert (
        kv.num_free_blocks == kv.block_pool.num_blocks - 1
    )  # the stopped request was aborted in the core


def test_earliest_ending_stop_string_wins():
    from pagellm.engine.output_processor import find_stop_string

    assert find_stop_string("hello world", 11, ["world", "lo w"], include=False) == ("lo w", 3)
    assert find_stop_string("hello world", 11, ["world", "lo w"], include=True) == ("lo w", 7)
    assert find_stop_string("abc", 1, ["x"], include=False) is None


def test_min_tokens_is_respected_and_suppresses_stops(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = llm.generate([[60, 61]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    first = tokens[0]
    stopped = llm.generate(
        [[60, 61]],
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[first]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.token_ids == [first]
    held = llm.generate(
        [[60, 61]],
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[first], min_tokens=5),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(held.token_ids) >= 5 and first not in held.token_ids[:5]


def test_chat_on_smollm2_answers_a_two_turn_conversation(smollm2_llm):
    llm = smollm2_llm
    conversation = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And what is the capital of Germany?"},
    ]
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)[
        0
    ].outputs[0]
    assert "Berlin" in out.text  # the follow-up only makes sense with the first turn
