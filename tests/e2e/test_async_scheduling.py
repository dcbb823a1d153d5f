"""Asynchronous scheduling gives exactly the tokens of synchronous scheduling.

The engine core plans step N+1 while step N runs (`EngineCore._step_overlapped`); on the CPU the
device work is synchronous, but every piece of the mechanism runs: placeholders in the scheduler,
the sampled ids fed to the next step's inputs on the device, results collected a step late,
speculative work discarded for requests that finished. Each case runs the same requests through
a synchronous and an asynchronous engine on a tiny random Llama and compares what they return.
"""

from __future__ import annotations

import logging
import random
import sys
from pathlib import Path

import pytest

from pagellm import LLM, SamplingParams

KV_ROOMY = 8 << 20
KV_TIGHT = 12 * 8192  # a few blocks: concurrent requests preempt each other


@pytest.fixture(scope="module")
def llama_dir(tiny_models):
    return tiny_models["llama3"]


def make_llm(llama_dir, async_scheduling: bool, kv_cache_memory: int = KV_ROOMY, **kwargs) -> LLM:
    return LLM(
        llama_dir,
        max_model_len=128,
        kv_cache_memory=kv_cache_memory,
        async_scheduling=async_scheduling,
        **kwargs,
    )


@pytest.fixture(scope="module")
def engines(llama_dir):
    return make_llm(llama_dir, False), make_llm(llama_dir, True)


def prompts_with_shared_prefix(count: int = 6) -> list[list[int]]:
    rng = random.Random(3)
    prefix = [rng.randrange(3, 1024) for _ in range(36)]
    return [prefix + [rng.randrange(3, 1024) for _ in range(1 + 4 * i)] for i in range(count)]


def core_of(llm: LLM):
    return llm.llm_engine.engine_core


def all_blocks_free(llm: LLM) -> bool:
    kv = core_of(llm).kv_cache_manager
    return kv.num_free_blocks == kv.block_pool.num_blocks - 1


def summary(outputs) -> list:
    """What a user sees, per request and completion (logprobs rounded: rows may be batched
    differently, as the asynchronous engine also runs the discarded step of a finished one)."""

    def rounded(positions):
        if positions is None:
            return None
        return [
            None if p is None else {t: round(lp.logprob, 4) for t, lp in p.items()}
            for p in positions
        ]

    return [
        (
            rounded(out.prompt_logprobs),
            [
                (c.token_ids, c.text, c.finish_reason, str(c.stop_reason), rounded(c.logprobs))
                for c in out.outputs
            ],
        )
        for out in outputs
    ]


def mixed_params(stop_token: int, stop_text: str) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=18, ignore_eos=True),
        SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(
            temperature=0.0, max_tokens=10, logprobs=2, prompt_logprobs=1, ignore_eos=True
        ),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.0, max_tokens=20, stop=[stop_text], ignore_eos=True),
    ]


def stops_from(llm: LLM, prompt: list[int]) -> tuple[int, str]:
    """A stop token and a stop string that the greedy output of ``prompt`` reaches midway."""
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    out = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    text = out.text
    return out.token_ids[6], text[len(text) // 2 : len(text) // 2 + 3]


def test_a_mix_of_requests_gives_the_same_outputs_and_leaks_no_block(engines):
    sync, overlapped = engines
    prompts = prompts_with_shared_prefix(7)
    stop_token, stop_text = stops_from(sync, prompts[5])
    params = mixed_params(stop_token, stop_text)
    expected = summary(sync.generate(prompts, params, use_tqdm=False))
    hits_before = core_of(overlapped).kv_cache_manager.prefix_cache_stats.hits
    assert summary(overlapped.generate(prompts, params, use_tqdm=False)) == expected
    # The cases really happened: prefix hits, stops midway, the one-token request.
    assert core_of(overlapped).kv_cache_manager.prefix_cache_stats.hits > hits_before
    finished = [c for _, completions in expected for c in completions]
    assert finished[6][2] == "stop" and len(finished[6][0]) < 20  # the stop token
    assert finished[7][2] == "stop" and stop_text not in finished[7][1]  # the stop string
    assert len(finished[4][0]) == 1
    assert all_blocks_free(overlapped) and not core_of(overlapped).in_flight


def test_preemption_under_a_tiny_kv_cache_gives_the_same_outputs(llama_dir, engines):
    sync, _ = engines
    prompts = prompts_with_shared_prefix(6)
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True),
    ] * 3
    expected = summary(sync.generate(prompts, params, use_tqdm=False))
    tight = make_llm(llama_dir, True, KV_TIGHT)
    assert summary(tight.generate(prompts, params, use_tqdm=False)) == expected
    assert core_of(tight).scheduler.num_preemptions > 0
    assert all_blocks_free(tight)


def test_the_engine_keeps_one_step_in_flight_and_aborts_drop_it(engines):
    sync, overlapped = engines
    prompts = prompts_with_shared_prefix(3)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    full = [o.outputs[0].token_ids for o in sync.generate(prompts, greedy, use_tqdm=False)]
    engine, core = overlapped.llm_engine, core_of(overlapped)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"abort-{i}", prompt, greedy)
    got: dict[str, list[int]] = {f"abort-{i}": [] for i in range(3)}
    finish: dict[str, str | None] = {}
    for step in range(40):
        for out in engine.step():
            got[out.request_id] = list(out.outputs[0].token_ids)
            finish[out.request_id] = out.outputs[0].finish_reason
        if step == 4:
            assert len(core.in_flight) == 1  # step N+1 launched before step N was collected
            for out in engine.abort_request("abort-1"):
                finish[out.request_id] = out.outputs[0].finish_reason
        if not engine.has_unfinished_requests():
            break
    assert got["abort-0"] == full[0] and got["abort-2"] == full[2]
    assert finish["abort-1"] == "abort"
    assert 0 < len(got["abort-1"]) < 16 and got["abort-1"] == full[1][: len(got["abort-1"])]
    assert all_blocks_free(overlapped) and not core.in_flight


def test_multi_token_bad_words_run_synchronously_with_the_reason_logged(engines, caplog):
    """The sampler reads the output's last tokens on the host to ban a bad word's last token,
    so such a request's steps do not overlap (logged once); the tokens stay the same."""
    sync, overlapped = engines
    prompts = prompts_with_shared_prefix(2)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = sync.generate(prompts, greedy, use_tqdm=False)
    # A bad word made of the greedy output's tokens 3 and 4: banning it changes the output.
    tokenizer = sync.get_tokenizer()
    word = tokenizer.decode(plain[0].outputs[0].token_ids[3:5]).strip()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, bad_words=[word])
    expected = summary(sync.generate(prompts, [params, greedy], use_tqdm=False))
    with caplog.at_level(logging.INFO, logger="pagellm.engine.core"):
        got = summary(overlapped.generate(prompts, [params, greedy], use_tqdm=False))
    assert got == expected
    assert expected[0][1][0][0] != list(plain[0].outputs[0].token_ids)
    assert "Asynchronous scheduling off for some steps: multi-token bad_words" in caplog.text


def test_prompt_logprobs_of_chunked_prefills_come_back_with_the_steps_copy(llama_dir, engines):
    """Chunks that sample nothing still send their prompt logprobs through the step's one
    device→host copy."""
    sync, _ = engines
    prompts = prompts_with_shared_prefix(3)
    params = SamplingParams(
        temperature=0.0, max_tokens=6, logprobs=1, prompt_logprobs=2, ignore_eos=True
    )
    expected = summary(sync.generate(prompts, params, use_tqdm=False))
    chunked = make_llm(llama_dir, True, max_num_batched_tokens=16)
    assert summary(chunked.generate(prompts, params, use_tqdm=False)) == expected
    assert all(len(p) == len(prompt) for (p, _), prompt in zip(expected, prompts, strict=True))


def test_after_a_failed_step_the_requests_run_alone_with_no_step_in_flight(engines, caplog):
    """Failure isolation needs each probe's result before the next step is planned: the
    engine drains (the reason logged), then overlaps again once the culprit is found."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "fault_injection"))
    import pagellm_fault_injection as faults

    sync, overlapped = engines
    prompts = prompts_with_shared_prefix(3)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in sync.generate(prompts, greedy, use_tqdm=False)]
    poison = 999
    engine, core = overlapped.llm_engine, core_of(overlapped)
    faults.install(poison, after=2)
    try:
        for i, prompt in enumerate([*prompts, [7, poison, 8]]):
            engine.add_request(f"probe-{i}", prompt, greedy)
        got, in_flight_while_isolating = {}, []
        with caplog.at_level(logging.INFO, logger="pagellm.engine.core"):
            while engine.has_unfinished_requests():
                for out in engine.step():
                    got[out.request_id] = (
                        list(out.outputs[0].token_ids),
                        out.outputs[0].finish_reason,
                    )
                if core.scheduler.quarantine or core.scheduler.probe is not None:
                    in_flight_while_isolating.append(len(core.in_flight))
    finally:
        faults.uninstall()
    assert in_flight_while_isolating and set(in_flight_while_isolating) == {0}
    assert "Asynchronous scheduling off for some steps: a failed step's" in caplog.text
    assert [got[f"probe-{i}"][0] for i in range(3)] == expected
    assert got["probe-3"][1] == "error"
    assert overlapped.llm_engine.output_processor.requests == {}
    assert all_blocks_free(overlapped)
