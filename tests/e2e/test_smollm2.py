"""The packaged SmolLM2-135M-Instruct GGUF: token-for-token parity with transformers loading the
same GGUF, and chat answers."""

from __future__ import annotations

import torch

from pagellm import SamplingParams

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


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )


def test_smollm2_gguf_greedy_matches_hf_on_eight_prompts(smollm2_llm, smollm2_hf_model):
    llm, hf_model = smollm2_llm, smollm2_hf_model
    tokenizer = llm.get_tokenizer()
    prompts = [chat_prompt_ids(tokenizer, q) for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens = list(out.outputs[0].token_ids)
        assert len(tokens) == 32
        # transformers' greedy choice after the prompt and after each of our tokens, from one
        # forward pass (teacher forcing): equal to ours at every step, its greedy generation is
        # ours token for token (up to the rounding of its KV-cached steps). One pass, not 32
        # decode steps: the suite's time.
        ids = torch.tensor([prompt + tokens[:-1]])
        with torch.no_grad():
            logits = hf_model(ids, attention_mask=torch.ones_like(ids)).logits[0]
        assert logits[len(prompt) - 1 :].argmax(-1).tolist() == tokens


def test_smollm2_answers_capital_of_france_with_paris(smollm2_llm):
    out = smollm2_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=32),
        use_tqdm=False,
    )[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ended on the chat's end-of-turn token
