"""The FP8 KV cache (``--kv-cache-dtype fp8``) end to end on TORCH_SDPA, the CPU backend: twice
the tokens in the same memory, the start-up log saying so, greedy and teacher-forced agreement with
the model-dtype cache, k/v scales read from the checkpoint under vLLM's names, the selector's
refusal of a backend that cannot read the cache, and the flag's bad values.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.attention.layer import Attention
from pagellm.attention.selector import NoAttentionBackendError, select_attention_backend
from pagellm.config import ConfigError
from pagellm.engine.args import EngineArgs
from pagellm.kv_cache.spec import KVCacheSpec
from pagellm.model_loader.kv_scales import take_kv_scales

KV_MEMORY = 4 << 20
PROMPTS = [[(7 * i + 3 * j) % 1000 + 3 for j in range(n)] for i, n in enumerate((5, 19, 33, 48))]


def make_llm(model: str, kv_cache_dtype: str, **kwargs) -> LLM:
    return LLM(
        model,
        dtype="bfloat16",
        max_model_len=256,
        kv_cache_memory=KV_MEMORY,
        attention_backend="TORCH_SDPA",
        kv_cache_dtype=kv_cache_dtype,
        **kwargs,
    )


def kv_capacity_tokens(llm: LLM) -> int:
    core = llm.llm_engine.core_client
    return core.kv_cache_manager.block_pool.num_blocks * core.config.cache.block_size


def attention_layers(llm: LLM) -> list[Attention]:
    model = llm.llm_engine.core_client.executor.worker.model_runner.model
    return [m for m in model.modules() if isinstance(m, Attention)]


def test_fp8_cache_doubles_the_tokens_and_the_log_says_so(tiny_models, caplog):
    with caplog.at_level(logging.INFO):
        fp8 = make_llm(tiny_models["llama3"], "fp8")
    auto = make_llm(tiny_models["llama3"], "auto")
    assert fp8.llm_engine.core_client.config.cache.cache_dtype == "fp8_e4m3"
    assert kv_capacity_tokens(fp8) == 2 * kv_capacity_tokens(auto)
    log = caplog.text
    assert (
        f"({kv_capacity_tokens(fp8)} tokens, 4.0 MiB), kv cache dtype fp8_e4m3 (float8_e4m3fn)"
        in log
    )
    assert "no k/v scales; 1.0 for every layer (not calibrated)" in log
    assert (
        "attention backend TORCH_SDPA, block size 16, dtype bfloat16, kv cache dtype fp8_e4m3"
        in log
    )


def test_fp8_cache_agrees_with_the_bf16_cache_greedy_and_teacher_forced(tiny_models):
    """Greedy tokens (reported: a random tiny model drifts once one token differs) and the
    top-1 token at every continuation position of the bf16-cache run's sequences fed back as
    prompts in 16-token chunks, so that later chunks attend to the quantized cache (>= 95 %
    agreement; the random prompts themselves are near-uniform predictions, left out)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    forced = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    runs = {}
    for kv in ("auto", "fp8"):
        llm = make_llm(tiny_models["llama3"], kv, long_prefill_token_threshold=16)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
        if kv == "auto":
            sequences = [p + t for p, t in zip(PROMPTS, tokens, strict=True)]
        outs = llm.generate(sequences, forced, use_tqdm=False)
        top1 = [
            [
                next(t for t, lp in pos.items() if lp.rank == 1)
                for pos in o.prompt_logprobs[len(prompt) :]
            ]
            for o, prompt in zip(outs, PROMPTS, strict=True)
        ]
        chosen = [
            [pos[tok].logprob for pos, tok in zip(o.prompt_logprobs[1:], seq[1:], strict=True)]
            for o, seq in zip(outs, sequences, strict=True)
        ]
        runs[kv] = tokens, top1, chosen
    same_greedy = sum(
        a == b
        for x, y in zip(runs["auto"][0], runs["fp8"][0], strict=True)
        for a, b in zip(x, y, strict=False)
    )
    pairs = [
        (a, b)
        for x, y in zip(runs["auto"][1], runs["fp8"][1], strict=True)
        for a, b in zip(x, y, strict=False)
    ]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    gap = max(
        abs(a - b)
        for x, y in zip(runs["auto"][2], runs["fp8"][2], strict=True)
        for a, b in zip(x, y, strict=False)
    )
    print(
        f"fp8 vs bf16 KV cache: greedy {same_greedy}/{48 * len(PROMPTS)} tokens equal, "
        f"teacher-forced top-1 {agreement:.1%} of {len(pairs)} positions, max logprob gap {gap:.3f}"
    )
    assert agreement >= 0.95


def test_kv_scales_come_from_the_checkpoint_under_vllms_names(tiny_models, tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "scaled"
    shutil.copytree(tiny_models["llama3"], model_dir)
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)  # compressed-tensors
    weights["model.layers.0.self_attn.v_scale"] = torch.tensor([0.25])
    weights["model.layers.1.self_attn.k_proj.k_scale"] = torch.tensor(2.0)  # ModelOpt
    save_file(weights, os.path.join(model_dir, "model.safetensors"))
    with caplog.at_level(logging.INFO):
        llm = make_llm(str(model_dir), "fp8_e4m3")
    scales = [(layer.impl.k_scale, layer.impl.v_scale) for layer in attention_layers(llm)]
    assert scales == [(0.5, 0.25), (2.0, 1.0)]
    assert "k/v scales from the checkpoint for 2 of 2 attention layers" in caplog.text
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_kv_scale_names_are_recognised_and_taken_out_of_the_weights():
    names = {
        "model.layers.0.self_attn.attn.k_scale": 1.5,
        "model.layers.0.self_attn.v_proj.v_scale": 2.5,
        "model.layers.1.self_attn.kv_scale": 3.0,
        "model.layers.2.self_attn.k_proj.output_scale": 4.0,
        "model.layers.2.self_attn.k_proj.weight_scale": 9.0,  # a weight's scale: not the cache's
        "model.layers.2.self_attn.k_proj.weight": 9.0,
    }
    found: dict[str, dict[str, float]] = {}
    rest = [n for n, _ in take_kv_scales(((n, torch.tensor(v)) for n, v in names.items()), found)]
    assert rest == [
        "model.layers.2.self_attn.k_proj.weight_scale",
        "model.layers.2.self_attn.k_proj.weight",
    ]
    assert found == {
        "model.layers.0.self_attn": {"k": 1.5, "v": 2.5},
        "model.layers.1.self_attn": {"k": 3.0, "v": 3.0},
        "model.layers.2.self_attn": {"k": 4.0},
    }
    with pytest.raises(NotImplementedError, match="only one scale per layer"):
        list(take_kv_scales([("m.self_attn.k_scale", torch.ones(4))], {}))
    with pytest.raises(ValueError, match="not a positive number"):
        list(take_kv_scales([("m.self_attn.v_scale", torch.tensor(0.0))], {}))


@pytest.mark.parametrize("backend", ["FLASHINFER", "FLASH_ATTN"])
def test_selector_refuses_a_backend_that_cannot_read_an_fp8_cache(backend):
    with pytest.raises(NoAttentionBackendError) as error:
        select_attention_backend(
            requested=backend,
            ranking=[],
            device_type="cuda",
            head_size=128,
            dtype=torch.bfloat16,
            block_size=16,
            sliding_window=None,
            kv_cache_dtype="fp8_e4m3",
        )
    message = str(error.value)
    assert f"attention backend {backend!r} cannot" in message
    assert "kv cache dtype fp8_e4m3 not supported (supports ['auto'])" in message


def test_the_selector_passes_over_backends_without_fp8_for_one_with_it():
    chosen = select_attention_backend(
        requested=None,
        ranking=["TORCH_SDPA"],
        device_type="cpu",
        head_size=32,
        dtype=torch.float32,
        block_size=None,
        sliding_window=None,
        kv_cache_dtype="fp8_e4m3",
    )
    assert "fp8_e4m3" in chosen.supported_kv_cache_dtypes


@pytest.mark.parametrize(
    "value, reason",
    [
        ("fp8_e5m2", "no attention backend here stores e5m2"),
        ("int8", "is not one of auto, fp8, fp8_e4m3"),
        ("float16", "is not one of auto, fp8, fp8_e4m3"),
    ],
)
def test_bad_kv_cache_dtypes_are_refused_with_the_reason(tiny_models, value, reason):
    args = EngineArgs(tiny_models["llama3"], kv_cache_dtype=value, max_model_len=64)
    with pytest.raises(ConfigError, match=reason):
        args.create_engine_config()


def test_page_size_follows_the_cache_dtype_not_the_compute_dtype():
    bf16 = KVCacheSpec(16, 8, 128, torch.bfloat16)
    fp8 = KVCacheSpec(16, 8, 128, torch.bfloat16, cache_dtype=torch.float8_e4m3fn)
    assert bf16.storage_dtype == torch.bfloat16 and fp8.dtype == torch.bfloat16
    assert bf16.page_size_bytes == 2 * fp8.page_size_bytes == 2 * 2 * 16 * 8 * 128
