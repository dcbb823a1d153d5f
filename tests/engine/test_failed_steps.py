"""A request that makes an engine step raise fails alone; the engine keeps serving the others.

The fault comes from the test plugin ``tests/fault_injection`` (its `install` patches the model
runner's input preparation in this process): a step raises while it runs a request whose prompt
holds the poison token. That is fault injection, not a mock: everything else is the real engine
on a tiny random Llama, and every other request must give exactly the greedy tokens of a run
without the poisoned request.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pagellm import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "fault_injection"))
import pagellm_fault_injection as faults  # noqa: E402

POISON = 999
NUM_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26], [30, 31]]
POISONED = [40, 41, POISON, 43]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(tiny_models, request):
    """One engine per scheduling mode: asynchronous scheduling must isolate a fault as well."""
    return LLM(
        tiny_models["llama3"],
        max_model_len=128,
        kv_cache_memory=8 << 20,
        async_scheduling=request.param,
    )


@pytest.fixture(scope="module")
def clean(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture
def injected():
    def install(after: int = 0) -> None:
        faults.install(POISON, after)

    yield install
    faults.uninstall()


def _all_blocks_free(llm) -> bool:
    kv = llm.llm_engine.engine_core.kv_cache_manager
    return kv.num_free_blocks == kv.block_pool.num_blocks - 1


@pytest.mark.parametrize("after", [0, 5], ids=["at-prefill", "mid-generation"])
def test_poisoned_request_fails_and_the_rest_of_its_batch_is_unchanged(llm, clean, injected, after):
    injected(after)
    prompts = [*PROMPTS[:2], POISONED, *PROMPTS[2:]]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert outputs[2].outputs[0].finish_reason == "error"
    others = [o.outputs[0] for i, o in enumerate(outputs) if i != 2]
    assert [c.token_ids for c in others] == clean
    assert all(c.finish_reason == "length" for c in others)
    scheduler = llm.llm_engine.engine_core.scheduler
    assert not scheduler.quarantine and scheduler.probe is None and not scheduler.resend
    assert _all_blocks_free(llm)


def test_poisoned_request_alone_fails_and_the_engine_serves_the_next(llm, clean, injected):
    injected()
    [failed] = llm.generate([POISONED], GREEDY, use_tqdm=False)
    assert failed.outputs[0].finish_reason == "error"
    faults.uninstall()
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == clean
    assert _all_blocks_free(llm)


def test_poisoned_n2_request_fails_whole_and_seeded_neighbours_are_unchanged(llm, injected):
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=NUM_NEW, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, seeded, use_tqdm=False)]
    injected(3)
    params = [seeded] * 2 + [SamplingParams(n=2, max_tokens=NUM_NEW, ignore_eos=True)]
    outputs = llm.generate([*PROMPTS[:2], POISONED], params, use_tqdm=False)
    assert {c.finish_reason for c in outputs[2].outputs} == {"error", "abort"}
    # The neighbours were set back and recomputed: a seeded request starts its generator again
    # from its seed then, so only the tokens before the fault are kept as they were sampled.
    assert [o.outputs[0].token_ids[:3] for o in outputs[:2]] == [t[:3] for t in before[:2]]
    assert all(len(o.outputs[0].token_ids) == NUM_NEW for o in outputs[:2])
    assert _all_blocks_free(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_steps_that_keep_failing_stop_the_engine(tiny_models, monkeypatch, async_scheduling):
    from pagellm.engine import core as engine_core

    monkeypatch.setattr(engine_core, "MAX_FAILED_STEPS_IN_A_ROW", 2)
    llm = LLM(
        tiny_models["llama3"],
        max_model_len=128,
        kv_cache_memory=8 << 20,
        async_scheduling=async_scheduling,
    )
    faults.install(POISON)
    try:
        with pytest.raises(RuntimeError, match="steps failed in a row"):
            llm.generate([POISONED] * 3, GREEDY, use_tqdm=False)
    finally:
        faults.uninstall()


def test_requests_set_apart_after_a_failed_step_are_waiting_deferred(llm, injected):
    """vLLM's waiting reason "deferred": the requests of a failed step wait for their turn to run
    alone; the Prometheus gauges count them as waiting, apart from those short of room."""
    from pagellm.metrics.prometheus import PrometheusStatLogger, metrics_response

    injected()
    engine = llm.llm_engine
    for i, prompt in enumerate([*PROMPTS[:2], POISONED]):
        engine.add_request(f"deferred-{i}", prompt, GREEDY)
    engine.step()  # the three run together, and the step raises
    core = engine.engine_core
    stats = core.make_scheduler_stats()
    assert (stats.num_deferred_reqs, stats.num_waiting_reqs, stats.num_running_reqs) == (3, 0, 0)
    assert core.get_state()["num_waiting"] == 3
    prometheus = PrometheusStatLogger("tiny")
    prometheus.record(stats, None)
    body = metrics_response(prometheus)[0].decode()
    assert 'pagellm:num_requests_waiting{model_name="tiny"} 3.0' in body
    assert 'pagellm:num_requests_waiting_by_reason{model_name="tiny",reason="deferred"} 3.0' in body
    assert 'pagellm:num_requests_waiting_by_reason{model_name="tiny",reason="capacity"} 0.0' in body
    while engine.has_unfinished_requests():
        engine.step()
    assert core.make_scheduler_stats().num_deferred_reqs == 0
    assert _all_blocks_free(llm)
