"""Models on the GPU against Hugging Face transformers with the same weights, and CUDA graphs on
versus off.

Random-weight Llama (llama3 RoPE), Qwen2 (qkv bias), Qwen3 (q/k norms, head size 128) and Mistral
(sliding window) configs are made and saved on the device; pagellm generates greedily with the
platform's attention backend; transformers then scores the same token sequences (teacher forcing)
so one early disagreement cannot cascade. Checked per generated position: pagellm's token is HF's
argmax (top-1 agreement) and pagellm's logprob of it is close to HF's.

Run on the GPU machine with ``pytest -m gpu``; skipped without CUDA.
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch

from pagellm.testing.greedy import chosen_logprobs, count_identical_with_near_ties, greedy_run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

COMMON = dict(
    vocab_size=2048,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
CONFIGS = {
    "llama3": dict(
        model_type="llama",
        head_dim=64,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=256,
        ),
    ),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=4),
    "qwen3": dict(model_type="qwen3", head_dim=128, tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", sliding_window=128, head_dim=64),
}
GPU_BACKENDS = ["TRITON_ATTN", "FLASHINFER", "FLASH_ATTN"]
"""The parity suite runs in bf16 on each of these that is installed and available (float32 runs
on the platform's choice: the FlashInfer and FlashAttention kernels take half precision only)."""
# (min top-1 agreement, max |logprob difference|) per dtype.
TOLERANCE = {"float32": (0.99, 2e-3), "bfloat16": (0.93, 0.15)}
NUM_NEW_TOKENS = 24


def _save_model(kind: str, directory: Path) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {**COMMON, **CONFIGS[kind]}
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.05)  # peaked logits: fewer near-ties between implementations
    model.save_pretrained(directory)
    del model
    torch.cuda.empty_cache()
    return str(directory)


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gpu_models")
    return {kind: _save_model(kind, root / kind) for kind in CONFIGS}


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 2048, n).tolist() for n in (7, 33, 150, 300, 517, 64, 1000, 260)]
    prompts.append(prompts[3][:200] + rng.integers(3, 2048, 40).tolist())  # shares a prefix
    return prompts


def _pagellm_generate(model: str, dtype: str, prompts: list[list[int]], **kwargs):
    from pagellm import LLM, SamplingParams

    llm = LLM(
        model,
        dtype=dtype,
        skip_tokenizer_init=True,
        max_model_len=2048,
        max_num_batched_tokens=512,  # chunked prefill with cached context
        kv_cache_memory=1 << 30,
        **kwargs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, logprobs=2, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # Per position the two most likely tokens' logprobs, the pick among them (a GreedyRun).
    result = [greedy_run(o.outputs[0]) for o in outputs]
    backend = llm.llm_engine.config.attention_backend
    del llm, outputs
    gc.collect()
    torch.cuda.empty_cache()
    return result, backend


def _hf_scores(model_dir: str, dtype: str, prompts, generations):
    """HF's argmax and logprob of pagellm's token at each generated position (teacher forcing)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    ).cuda()
    argmaxes, logprobs = [], []
    with torch.inference_mode():
        for prompt, (tokens, _) in zip(prompts, generations, strict=True):
            ids = torch.tensor([prompt + tokens], device="cuda")
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
            argmaxes.append(logits.argmax(-1).tolist())
            logprobs.append(
                logits.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0].tolist()
            )
    del model
    torch.cuda.empty_cache()
    return argmaxes, logprobs


def _agreement_with_hf(generations, argmaxes, hf_logprobs) -> tuple[int, int, float]:
    """Positions where pagellm's token is HF's argmax, positions in all, and the largest
    |logprob difference| of pagellm's tokens."""
    agree = total = 0
    worst = 0.0
    for run, hf_top, hf_lps in zip(generations, argmaxes, hf_logprobs, strict=True):
        tokens, our_lps = run[0], chosen_logprobs(run)
        agree += sum(a == b for a, b in zip(tokens, hf_top, strict=True))
        total += len(tokens)
        worst = max(worst, max(abs(a - b) for a, b in zip(our_lps, hf_lps, strict=True)))
    return agree, total, worst


def _skip_unless_available(backend: str) -> None:
    from pagellm.attention.registry import attention_backends

    if backend not in attention_backends.names():
        pytest.skip(f"{backend} is not installed")
    reason = attention_backends.get(backend).is_available()
    if reason is not None:
        pytest.skip(f"{backend} is unavailable: {reason}")


@pytest.mark.parametrize(
    "dtype, requested",
    [("float32", None)] + [("bfloat16", backend) for backend in GPU_BACKENDS],
    ids=["float32"] + [f"bfloat16-{backend}" for backend in GPU_BACKENDS],
)
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_greedy_matches_transformers_on_gpu(
    gpu_models, kind: str, dtype: str, requested: str | None
) -> None:
    if requested is not None:
        _skip_unless_available(requested)
    prompts = _prompts()
    generations, backend = _pagellm_generate(
        gpu_models[kind], dtype, prompts, attention_backend=requested
    )
    assert requested is None or backend == requested
    argmaxes, hf_logprobs = _hf_scores(gpu_models[kind], dtype, prompts, generations)
    assert all(len(tokens) == NUM_NEW_TOKENS for tokens, _ in generations)
    agree, total, worst = _agreement_with_hf(generations, argmaxes, hf_logprobs)
    min_agree, max_diff = TOLERANCE[dtype]
    print(f"{kind} {dtype} {backend}: top-1 agreement {agree}/{total}, max |dlogprob| {worst:.4f}")
    assert agree / total >= min_agree, f"top-1 agreement {agree}/{total} with {backend}"
    assert worst <= max_diff, f"max logprob difference {worst} with {backend}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_give_the_same_tokens_as_eager(gpu_models, dtype: str) -> None:
    prompts = _prompts()
    graphs, _ = _pagellm_generate(gpu_models["qwen3"], dtype, prompts)
    eager, _ = _pagellm_generate(gpu_models["qwen3"], dtype, prompts, enforce_eager=True)
    # Replays pad a decode batch up to a capture size, which can change the matmul kernels cuBLAS
    # picks, so in bf16 two near-tied tokens may swap: the runs may part only at a near-tie
    # (`pagellm.testing.greedy`). In float32 every sequence is the same.
    tol = 1e-4 if dtype == "float32" else 0.1
    identical = count_identical_with_near_ties(graphs, eager, tol, dtype)
    min_identical = len(prompts) if dtype == "float32" else 1
    assert identical >= min_identical, f"{identical}/{len(prompts)} sequences identical"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_async_scheduling_gives_the_same_tokens_on_gpu(gpu_models, dtype: str) -> None:
    """One step in flight (the sampled ids fed to the next step on the device, their copy back
    on a side stream), with CUDA graphs, against synchronous steps. No request ends before its
    max_tokens, so both run the same batches step by step: the same tokens and logprobs."""
    prompts = _prompts()
    sync, _ = _pagellm_generate(gpu_models["llama3"], dtype, prompts)
    overlapped, _ = _pagellm_generate(gpu_models["llama3"], dtype, prompts, async_scheduling=True)
    assert [tokens for tokens, _ in overlapped] == [tokens for tokens, _ in sync]
    for a, b in zip(overlapped, sync, strict=True):
        gaps = zip(chosen_logprobs(a), chosen_logprobs(b), strict=True)
        assert max(abs(x - y) for x, y in gaps) <= 1e-5


def test_cuda_graphs_are_captured_and_replayed(gpu_models) -> None:
    from pagellm import LLM, SamplingParams

    llm = LLM(
        gpu_models["llama3"],
        skip_tokenizer_init=True,
        max_model_len=1024,
        max_num_seqs=16,
        kv_cache_memory=1 << 30,
    )
    config = llm.llm_engine.config
    assert config.compilation.cudagraph_mode == "decode_and_piecewise"  # the default
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    assert runner.graphs.sizes and runner.graphs.sizes[-1] == 16
    replays = 0
    for graph in runner.graphs.captured.values():
        original = graph.replay

        def counting(original=original):
            nonlocal replays
            replays += 1
            original()

        graph.replay = counting
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}] * 3, params, use_tqdm=False)
    assert replays >= 7  # every decode step after the prefill
