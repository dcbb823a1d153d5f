"""Greedy outputs equal Hugging Face transformers token for token (float32, CPU, same weights)."""

from __future__ import annotations

import random

import pytest
import torch

from pagellm import LLM, SamplingParams

NUM_NEW_TOKENS = 32


def mixed_prompts(seed: int = 0, vocab: int = 1024) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 9, 17, 24, 33, 41, 50, 64]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def hf_greedy(model_dir: str, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=num_new,
                min_new_tokens=0,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def references(tiny_models: dict[str, str]) -> dict[str, list[list[int]]]:
    prompts = mixed_prompts()
    return {kind: hf_greedy(path, prompts, NUM_NEW_TOKENS) for kind, path in tiny_models.items()}


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("kind", ["llama3", "mistral", "qwen2", "qwen3"])
def test_greedy_batch_matches_hf_token_for_token(kind, tiny_models, references):
    llm = LLM(tiny_models[kind], dtype="float32", max_model_len=256, kv_cache_memory=64 << 20)
    outputs = llm.generate(mixed_prompts(), GREEDY, use_tqdm=False)
    for out, ref in zip(outputs, references[kind], strict=True):
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"
