"""Tensor parallelism on two GPUs (NCCL): TP = 2 against transformers and against TP = 1.

The random-weight models of `test_gpu_models` (Llama with llama3 RoPE, Qwen3 with head size 128
and tied embeddings, Mistral with a sliding window and two KV heads, one per rank) generate
greedily in bf16 through the multiprocess executor at TP = 1 and TP = 2, with CUDA graphs and
eagerly. TP = 2 is held to the single-GPU suite's bar against HF (teacher forcing: top-1
agreement and logprob closeness per generated position); against TP = 1, up to the first token
where the two differ, their logprobs agree, and at that token both picks are near-ties.

Run on a machine with two GPUs (`pytest -m gpu tests/e2e/test_gpu_tensor_parallel.py`); skipped
with fewer. NVLink multicast stays off in every process the run starts (the variables below).
"""

from __future__ import annotations

import os

import pytest
import torch

from pagellm.testing.greedy import count_identical_with_near_ties
from test_gpu_models import (
    TOLERANCE,
    _agreement_with_hf,
    _hf_scores,
    _pagellm_generate,
    _prompts,
    _save_model,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
    ),
]

NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
KINDS = ["llama3", "qwen3", "mistral"]
# bf16, two ranks: the all-reduce adds the halves in another order than one GPU's GEMM.
NEAR_TIE = 0.1


@pytest.fixture(scope="module", autouse=True)
def no_multicast():
    saved = {name: os.environ.get(name) for name in NO_MULTICAST}
    os.environ.update(NO_MULTICAST)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_models")
    return {kind: _save_model(kind, root / kind) for kind in KINDS}


def _generate(model: str, tp: int, eager: bool):
    generations, _ = _pagellm_generate(
        model,
        "bfloat16",
        _prompts(),
        tensor_parallel_size=tp,
        distributed_executor_backend="mp",
        enforce_eager=eager,
    )
    return generations


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_match_transformers_and_one_rank(tp_models, kind: str, eager: bool) -> None:
    prompts = _prompts()
    two = _generate(tp_models[kind], 2, eager)
    one = _generate(tp_models[kind], 1, eager)
    argmaxes, hf_logprobs = _hf_scores(tp_models[kind], "bfloat16", prompts, two)
    agree, total, worst = _agreement_with_hf(two, argmaxes, hf_logprobs)
    identical = count_identical_with_near_ties(two, one, NEAR_TIE, kind)
    min_agree, max_diff = TOLERANCE["bfloat16"]
    print(
        f"{kind} TP=2 {'eager' if eager else 'graphs'}: top-1 agreement with HF {agree}/{total}, "
        f"max |dlogprob| {worst:.4f}; {identical}/{len(prompts)} sequences as TP=1's"
    )
    assert agree / total >= min_agree, f"top-1 agreement {agree}/{total}"
    assert worst <= max_diff, f"max logprob difference {worst}"
    # Where the runs part, the picks are a near-tie (checked above): the sums' order differs.
    assert identical >= 1, f"{identical}/{len(prompts)} sequences as TP=1's"
