"""Tiny float32 models split over two gloo ranks give the one-rank engine's greedy tokens and
log-probabilities.

Each spawned rank joins a tensor-parallel group of two, then runs a whole `LLM` (the normal loader,
its own scheduler, a worker in its own process): both ranks see the same requests and schedule
them alike, so their collectives pair up, which is what the multiprocess executor provides by
broadcasting one schedule."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from pagellm import LLM, SamplingParams
from pagellm.distributed import destroy_distributed, init_distributed

PROMPTS = [[5, 17, 300, 41], [900, 3, 3, 77, 12, 640, 8, 8, 201]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
ENGINE = dict(dtype="float32", max_model_len=128, kv_cache_memory=8 << 20, max_num_seqs=4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _generate(model: str) -> dict[str, Any]:
    """Greedy tokens, top log-probabilities, and the KV heads this rank's cache holds."""
    llm = LLM(model, **ENGINE)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    heads = llm.llm_engine.engine_core.executor.collective_rpc(
        lambda worker: worker.model_runner.kv_cache_spec.num_kv_heads
    )
    return {
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "logprobs": [
            [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs or []]
            for o in outputs
        ],
        "kv_heads": heads[0],
    }


def _rank(rank: int, port: int, models: list[str], results: dict) -> None:
    init_distributed(
        world_size=2,
        rank=rank,
        tensor_parallel_size=2,
        init_method=f"tcp://127.0.0.1:{port}",
        backend="gloo",
    )
    results[rank] = [_generate(model) for model in models]
    destroy_distributed()


@pytest.fixture(scope="module")
def models(tiny_models, tiny_one_kv_head_models) -> dict[str, str]:
    return {
        "llama3_one_kv_head": tiny_one_kv_head_models["llama3"],
        "qwen3_one_kv_head": tiny_one_kv_head_models["qwen3"],
        "qwen2": tiny_models["qwen2"],  # q/k/v biases
        "mistral": tiny_models["mistral"],  # tied embeddings, sliding window, two KV heads
    }


def test_two_ranks_match_one_rank_greedy_tokens_and_logprobs(models):
    import torch.multiprocessing as mp

    paths = list(models.values())
    port = _free_port()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(port, paths, results), nprocs=2, join=True)
        by_rank = dict(results)
    for i, (kind, path) in enumerate(models.items()):
        single = _generate(path)
        kv_heads = 1 if "one_kv_head" in kind else 2
        assert single["kv_heads"] == kv_heads
        for rank in (0, 1):
            split = by_rank[rank][i]
            assert split["tokens"] == single["tokens"], (kind, rank)
            # One KV head per rank: its share of two, or the single one replicated.
            assert split["kv_heads"] == 1, (kind, rank)
            for got, want in zip(split["logprobs"], single["logprobs"], strict=True):
                for g, w in zip(got, want, strict=True):
                    assert g.keys() == w.keys(), (kind, rank)
                    for token, value in w.items():
                        assert abs(g[token] - value) < 1e-5, (kind, rank, token)
