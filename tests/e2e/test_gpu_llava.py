"""The LLaVA-style model on the GPU in bfloat16 with TRITON_ATTN, against Hugging Face
transformers' ``LlavaForConditionalGeneration`` with the same random weights.

A random LLaVA (CLIP tower of 224×224 images in 14×14 patches: 256 image tokens; a Llama decoder
of head size 64) is made and saved on the device. pagellm generates greedily for prompts with one
and two images and a text-only one, in one batch, with chunks of 128 tokens cutting through the
image spans; transformers then scores the same sequences (teacher forcing). Per generated
position: pagellm's token is HF's argmax (top-1 agreement) and its logprob is close to HF's.

Run on the GPU machine with ``pytest -m gpu``; skipped without CUDA.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 2048
IMAGE_TOKEN = VOCAB - 1
IMAGE_TOKENS = (224 // 14) ** 2
NUM_NEW = 24
MIN_TOP1, MAX_LOGPROB_GAP = 0.93, 0.15  # bfloat16, as the text models' GPU parity


def _save_llava(directory: Path) -> str:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig
    from transformers import LlavaForConditionalGeneration as HFLlava

    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            image_size=224,
            patch_size=14,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=3,
            num_attention_heads=4,
        ),
        text_config=LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=2048,
            bos_token_id=1,
            eos_token_id=2,
        ),
        image_token_id=IMAGE_TOKEN,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = HFLlava(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.05)
    model.save_pretrained(directory)
    # The image processor (pagellm-io-image, where installed) reads the checkpoint's preprocessing
    # even though these prompts bring their pixels ready.
    try:  # transformers' PIL-backed class, where this version has one
        from transformers import CLIPImageProcessorPil as ImageProcessor
    except ImportError:
        from transformers import CLIPImageProcessor as ImageProcessor

    processor = ImageProcessor(
        size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}
    ).to_dict()
    processor["image_processor_type"] = "CLIPImageProcessor"
    (directory / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    return str(directory)


def _prompts() -> list[dict]:
    from pagellm.multimodal import MultiModalItem

    generator = torch.Generator().manual_seed(1)

    def text(n: int) -> list[int]:
        return torch.randint(3, VOCAB - 1, (n,), generator=generator).tolist()

    def prompt(*parts: int | str) -> dict:
        ids: list[int] = []
        items = []
        for part in parts:
            if part == "image":
                image = torch.randn(3, 224, 224, generator=generator)
                items.append(MultiModalItem.from_tensor("image", image, len(ids), IMAGE_TOKENS))
                ids += [IMAGE_TOKEN] * IMAGE_TOKENS
            else:
                ids += text(int(part))
        return {"prompt_token_ids": ids, "multi_modal_items": items}

    return [prompt(5, "image", 20), prompt(40, "image", 7, "image", 3), prompt(90), prompt("image")]


def test_llava_bf16_triton_attn_agrees_with_transformers(tmp_path: Path):
    from transformers import LlavaForConditionalGeneration as HFLlava

    from pagellm import LLM, SamplingParams
    from pagellm.attention.registry import attention_backends

    if "TRITON_ATTN" not in attention_backends.names():
        pytest.skip("TRITON_ATTN is not installed")
    model_dir = _save_llava(tmp_path / "llava")
    prompts = _prompts()
    llm = LLM(
        model_dir,
        dtype="bfloat16",
        attention_backend="TRITON_ATTN",
        skip_tokenizer_init=True,
        max_model_len=2048,
        max_num_batched_tokens=128,  # chunks cut through the 256-token image spans
        kv_cache_memory=1 << 30,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, logprobs=1, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.shutdown()
    del llm
    hf = HFLlava.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    hf = hf.cuda().eval()
    agree, total, gap = 0, 0, 0.0
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        ids = torch.tensor([prompt["prompt_token_ids"] + tokens], device="cuda")
        images = [item.tensor() for item in prompt["multi_modal_items"]]
        pixels = torch.stack(images).to("cuda", torch.bfloat16) if images else None
        with torch.inference_mode():
            logits = hf(input_ids=ids, pixel_values=pixels).logits[0]
        ref = logits[len(prompt["prompt_token_ids"]) - 1 : -1].float().log_softmax(-1)
        agree += sum(int(a == t) for a, t in zip(ref.argmax(-1).tolist(), tokens, strict=True))
        total += len(tokens)
        for position, (lp, token) in enumerate(zip(completion.logprobs, tokens, strict=True)):
            gap = max(gap, abs(lp[token].logprob - ref[position, token].item()))
    assert agree / total >= MIN_TOP1, f"top-1 agreement {agree}/{total}"
    assert gap <= MAX_LOGPROB_GAP, f"max logprob gap {gap:.3f}"
