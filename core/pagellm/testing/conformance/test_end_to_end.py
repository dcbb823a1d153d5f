"""Greedy end to end: a tiny random Llama (GQA, prompts over several blocks, chunked by a small
token budget, a prefix-cache hit) gives the same tokens through the engine as through Hugging Face
transformers (float32), or, in a half-precision dtype, as the engine with TORCH_SDPA on the same
platform up to the first near tie."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.attention.backends.torch_sdpa import TorchSDPABackend
from pagellm.testing.conformance.compare import ConformanceFailure
from pagellm.testing.conformance.probes import default_dtype, default_head_size, dtype_name
from pagellm.testing.conformance.targets import BackendTarget, PlatformTarget
from pagellm.testing.conformance.tiny_model import MAX_TOKENS, hf_greedy, prompts

NEAR_TIE = 0.05
"""Top-two logprob gap under which a half-precision reference token may differ."""


def _generate(model: str, **engine: Any) -> tuple[list[list[int]], list[Any]]:
    llm = LLM(
        model,
        skip_tokenizer_init=True,
        max_model_len=128,
        max_num_batched_tokens=16,  # prompts in chunks, next to the others' decodes
        kv_cache_memory=8 << 20,
        enable_prefix_caching=True,
        **engine,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], [o.outputs[0].logprobs for o in outputs]


def _divergence(got: list[list[int]], expected: list[list[int]], logprobs: list[Any] | None) -> str:
    """Where ``got`` first leaves ``expected`` (ignoring a prompt once its reference reaches a
    near tie), or ''."""
    for p, (g, e) in enumerate(zip(got, expected, strict=True)):
        for i, (gt, et) in enumerate(zip(g, e, strict=True)):
            if logprobs is not None:
                top = sorted((lp.logprob for lp in logprobs[p][i].values()), reverse=True)
                if len(top) > 1 and top[0] - top[1] < NEAR_TIE:
                    break
            if gt != et:
                return f"prompt {p} ({len(prompts()[p])} tokens), token {i}: got {g}, expected {e}"
    return ""


def _assert_greedy_parity(model: str, dtype: torch.dtype, device_type: str, **engine: Any) -> str:
    """The reference's name; a `ConformanceFailure` unless the engine matches it."""
    got, _ = _generate(model, dtype=dtype_name(dtype), **engine)
    if dtype == torch.float32:
        expected, logprobs, reference = (
            hf_greedy(model, prompts(), MAX_TOKENS),
            None,
            "transformers",
        )
    elif device_type in TorchSDPABackend.supported_device_types:
        reference = f"{TorchSDPABackend.name} in {dtype_name(dtype)}"
        expected, logprobs = _generate(
            model, dtype=dtype_name(dtype), attention_backend=TorchSDPABackend.name
        )
    else:
        pytest.skip(f"no float32 and no {TorchSDPABackend.name} on device type {device_type}")
    found = _divergence(got, expected, logprobs)
    if found:
        raise ConformanceFailure(f"greedy tokens differ from {reference}'s: {found}")
    return reference


def test_backend_greedy_tokens_match_the_reference(
    backend: BackendTarget, tiny_llama: Callable[[int], str]
) -> None:
    cls = backend.skip_unless_usable()
    model = tiny_llama(default_head_size(backend))
    _assert_greedy_parity(
        model,
        default_dtype(cls),
        str(backend.device_type),
        attention_backend=backend.name,
        block_size=cls.default_block_size,
    )


def test_platform_greedy_tokens_match_the_reference(
    platform: PlatformTarget, tiny_llama: Callable[[int], str]
) -> None:
    """With the attention backend the platform chooses for a model of head size 64."""
    cls = platform.require_device()
    dtype = torch.float32 if torch.float32 in cls.supported_dtypes else cls.default_dtype(None)
    _assert_greedy_parity(tiny_llama(64), dtype, cls.device_type)
