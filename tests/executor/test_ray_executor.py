"""`RayExecutor` on a local Ray instance of 2 CPUs: the TP = 2 parity test of the multiprocess
executor, with the ranks as Ray actors."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'pagellm[ray]')")

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26], [30, 31]]
ENGINE = {"max_model_len": 128, "kv_cache_memory": 8 << 20}


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_tp2_through_ray_actors_gives_the_tokens_of_one_worker(tiny_models, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    reference = _tokens(LLM(tiny_models["llama3"], **ENGINE))
    llm = LLM(
        tiny_models["llama3"], tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE
    )
    try:
        executor = llm.llm_engine.engine_core.executor
        assert _tokens(llm) == reference
        assert executor.collective_rpc("parallel_rank") == [0, 1]
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert not ray.is_initialized()
