"""Greedy outputs do not depend on prefix caching, chunked prefill or preemption.

Every configuration is compared with Hugging Face transformers on the same tiny Llama, and each
test also checks that the mechanism it is about really ran (cache hits, chunks, preemptions).
"""

from __future__ import annotations

import logging
import random

import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine.warm_up import warm_up
from test_model_parity import hf_greedy

NUM_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def shared_prefix_prompts() -> list[list[int]]:
    rng = random.Random(1)
    prefix = [rng.randrange(3, 1024) for _ in range(40)]
    return [prefix + [rng.randrange(3, 1024) for _ in range(n)] for n in (1, 5, 12, 20, 27, 33)]


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_scheduling(request):
    """Every case with the next step scheduled after the current one's results, and while it
    runs (asynchronous scheduling: the same tokens)."""
    return request.param


@pytest.fixture(scope="module")
def llama_dir(tiny_models):
    return tiny_models["llama3"]


@pytest.fixture(scope="module")
def reference(llama_dir):
    return hf_greedy(llama_dir, shared_prefix_prompts(), NUM_NEW)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def core_of(llm):
    return llm.llm_engine.engine_core


def test_prefix_caching_off_and_on_give_hf_outputs_and_second_pass_hits(
    llama_dir, reference, async_scheduling
):
    prompts = shared_prefix_prompts()
    off = LLM(
        llama_dir,
        async_scheduling=async_scheduling,
        max_model_len=128,
        kv_cache_memory=8 << 20,
        enable_prefix_caching=False,
    )
    assert token_ids(off.generate(prompts, GREEDY, use_tqdm=False)) == reference

    on = LLM(
        llama_dir,
        async_scheduling=async_scheduling,
        max_model_len=128,
        kv_cache_memory=8 << 20,
        enable_prefix_caching=True,
    )
    assert token_ids(on.generate(prompts, GREEDY, use_tqdm=False)) == reference
    stats = core_of(on).kv_cache_manager.prefix_cache_stats
    hits_first = stats.hits
    second = on.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(second) == reference
    # The second pass finds every full prompt block of the first pass.
    assert stats.hits - hits_first >= sum((len(p) - 1) // 16 * 16 for p in prompts)
    kv = core_of(on).kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_blocks - 1


def test_chunked_prefill_under_small_budget_gives_hf_outputs(
    llama_dir, reference, async_scheduling
):
    prompts = shared_prefix_prompts()
    llm = LLM(
        llama_dir,
        async_scheduling=async_scheduling,
        max_model_len=128,
        kv_cache_memory=8 << 20,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    scheduler = core_of(llm).scheduler
    chunks = []
    original = scheduler.schedule

    def recording_schedule():
        out = original()
        chunks.append(out.total_num_scheduled_tokens)
        return out

    scheduler.schedule = recording_schedule
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert max(chunks) <= 16 < max(len(p) for p in prompts)


def test_tiny_kv_cache_forces_preemption_and_gives_hf_outputs(
    llama_dir, reference, async_scheduling
):
    prompts = shared_prefix_prompts()
    # 2 layers x K/V x 16 tokens x 2 heads x 16 dims x 4 bytes = 8 KiB a block: 12 blocks.
    llm = LLM(
        llama_dir,
        async_scheduling=async_scheduling,
        max_model_len=128,
        kv_cache_memory=12 * 8192,
        enable_prefix_caching=False,
    )
    core = core_of(llm)
    assert core.kv_cache_manager.block_pool.num_blocks == 12
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert core.scheduler.num_preemptions > 0
    assert core.kv_cache_manager.num_free_blocks == 11


def test_preemption_with_prefix_caching_and_chunking_together(
    llama_dir, reference, async_scheduling
):
    prompts = shared_prefix_prompts()
    llm = LLM(
        llama_dir,
        async_scheduling=async_scheduling,
        max_model_len=128,
        kv_cache_memory=12 * 8192,
        max_num_batched_tokens=20,
        enable_prefix_caching=True,
    )
    for _ in range(2):
        assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    core = core_of(llm)
    assert core.scheduler.num_preemptions > 0
    assert core.kv_cache_manager.num_free_blocks == 11


def hf_greedy_with_repetition_penalty(llama_dir, prompts, num_new, penalty):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=num_new,
                do_sample=False,
                repetition_penalty=penalty,
                eos_token_id=None,
                pad_token_id=0,
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def test_repetition_penalty_matches_hf_and_survives_preemption(llama_dir, async_scheduling):
    # Repeating prompts: without the penalty the greedy output would echo them.
    prompts = [[5, 6, 7, 8] * 6, [40, 41] * 15, [100 + i for i in range(30)]]
    expected = hf_greedy_with_repetition_penalty(llama_dir, prompts, NUM_NEW, 1.8)
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, repetition_penalty=1.8
    )
    roomy = LLM(
        llama_dir, async_scheduling=async_scheduling, max_model_len=128, kv_cache_memory=8 << 20
    )
    assert token_ids(roomy.generate(prompts, params, use_tqdm=False)) == expected
    # The penalty's token counts are kept per batch row on the device and updated each step;
    # preemption (rows freed, refilled later, rows moved by condensing) must not change them.
    tight = LLM(
        llama_dir,
        async_scheduling=async_scheduling,
        max_model_len=128,
        kv_cache_memory=12 * 8192,
        enable_prefix_caching=False,
    )
    assert token_ids(tight.generate(prompts * 2, params, use_tqdm=False)) == expected * 2
    assert core_of(tight).scheduler.num_preemptions > 0


def test_frequency_and_presence_penalties_are_counted_incrementally(llama_dir, async_scheduling):
    prompts = [[5, 6, 7, 8] * 6, [40, 41] * 15, [100 + i for i in range(30)]]
    plain = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    penalized = SamplingParams(
        temperature=0.0,
        max_tokens=NUM_NEW,
        ignore_eos=True,
        presence_penalty=2.0,
        frequency_penalty=2.0,
    )
    llm = LLM(
        llama_dir, async_scheduling=async_scheduling, max_model_len=128, kv_cache_memory=8 << 20
    )
    # A penalized request next to plain ones: the plain ones are untouched by its statistics.
    mixed = llm.generate(prompts + prompts, [penalized] * 3 + [plain] * 3, use_tqdm=False)
    alone_plain = llm.generate(prompts, plain, use_tqdm=False)
    assert token_ids(mixed[3:]) == token_ids(alone_plain)
    assert token_ids(mixed[:3]) != token_ids(alone_plain)  # the penalties did something
    for out in token_ids(mixed[:3]):
        # With both penalties at 2.0 (logits of this model are O(1)), a generated token is
        # pushed far down once produced: the outputs repeat far less than the plain ones.
        assert len(set(out)) >= len(out) - 4
    tight = LLM(
        llama_dir,
        async_scheduling=async_scheduling,
        max_model_len=128,
        kv_cache_memory=12 * 8192,
        enable_prefix_caching=False,
    )
    again = tight.generate(prompts * 2, penalized, use_tqdm=False)
    assert token_ids(again) == token_ids(mixed[:3]) * 2
    assert core_of(tight).scheduler.num_preemptions > 0


def test_start_up_warm_up_leaves_no_trace(llama_dir, reference, async_scheduling, caplog):
    """The warm-up a GPU engine runs at start (`pagellm.engine.warm_up`, for platforms that
    `needs_warm_up`; not the CPU), run here by hand: the logits at every row count, then warm-up
    requests, which the workers forget; the engine's scheduler and KV cache never saw them, and
    the outputs that follow still equal transformers'."""
    llm = LLM(
        llama_dir,
        async_scheduling=async_scheduling,
        max_model_len=128,
        kv_cache_memory=8 << 20,
        enable_prefix_caching=True,
    )
    core = core_of(llm)
    with caplog.at_level(logging.INFO, logger="pagellm.engine.warm_up"):
        warm_up(core.config, core.executor, core.kv_cache_manager.block_pool.num_blocks)
    rows = core.config.scheduler.max_num_seqs
    assert f"the logits at 1 to {rows} rows in" in caplog.text
    runner = core.executor.collective_rpc(lambda worker: worker.model_runner)[0]
    assert runner.input_batch.req_id_to_index == {} and not runner.requests
    assert not core.scheduler.requests and core.kv_cache_manager.prefix_cache_stats.queries == 0
    assert token_ids(llm.generate(shared_prefix_prompts(), GREEDY, use_tqdm=False)) == reference
    kv = core.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_blocks - 1
