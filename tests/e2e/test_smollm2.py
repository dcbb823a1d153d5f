"""The packaged SmolLM2-135M-Instruct GGUF: token-for-token parity with transformers loading the
same GGUF, and chat answers."""

from __future__ import annotations

import os

import pytest
import torch

from pagellm import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Explain photosynthesis in one sentence.",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What is the boiling point of water in Celsius?",
]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, max_model_len=1024, kv_cache_memory=256 << 20)


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(smollm2_path)
    return AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32
    ).eval()


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )


def test_smollm2_gguf_greedy_matches_hf_on_eight_prompts(llm, hf_model):
    tokenizer = llm.get_tokenizer()
    prompts = [chat_prompt_ids(tokenizer, q) for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == ref


def test_smollm2_answers_capital_of_france_with_paris(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=32),
        use_tqdm=False,
    )[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ended on the chat's end-of-turn token
