"""Images into the tiny LLaVA end to end: offline (`LLM.generate` with vLLM's
``multi_modal_data``, `LLM.chat` with image parts) against transformers with its own image
processor, and through a real ``pagellm serve`` with the official ``openai`` client: image chats
answer as offline, bad images get HTTP 400 and the server goes on."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from pagellm import LLM, SamplingParams
from pagellm.io_processors import IOProcessorInputError
from servers import Server, ServerSpecs, module_servers

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = "USER: <image>\nWhat is in this picture? ASSISTANT:"


def picture(seed: int, width: int = 48, height: int = 40) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_message(url: str, text: str = "What is in this picture?") -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": text},
            ],
        }
    ]


@pytest.fixture(scope="module")
def llm(tiny_llava: str) -> LLM:
    return LLM(tiny_llava, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)


def test_the_architecture_s_default_io_processor_is_the_image_one(llm):
    assert llm.llm_engine.config.model.io_processor == "image"
    assert type(llm.llm_engine.io_processor).__name__ == "ImageProcessor"


def test_generate_with_a_pil_image_matches_transformers_and_its_image_processor(llm, tiny_llava):
    from transformers import AutoTokenizer, CLIPImageProcessorPil, LlavaForConditionalGeneration

    image = picture(0)
    [out] = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image}}, GREEDY)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llava)
    hf = LlavaForConditionalGeneration.from_pretrained(tiny_llava, dtype=torch.float32).eval()
    pixels = CLIPImageProcessorPil.from_pretrained(tiny_llava)(images=image, return_tensors="pt")
    ids = []
    for token in tokenizer.encode(PROMPT):
        ids += [token] * (16 if token == hf.config.image_token_id else 1)
    assert out.prompt_token_ids == ids
    with torch.no_grad():
        ref = hf.generate(
            input_ids=torch.tensor([ids]),
            pixel_values=pixels["pixel_values"],
            max_new_tokens=8,
            do_sample=False,
        )
    assert list(out.outputs[0].token_ids) == ref[0, len(ids) :].tolist()


def test_chat_takes_pil_and_data_url_image_parts_as_generate_takes_the_rendered_prompt(llm):
    image = picture(1)
    as_pil = [
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": image},
                {"type": "text", "text": "Describe it."},
            ],
        }
    ]
    [pil] = llm.chat(as_pil, GREEDY, use_tqdm=False)
    [url] = llm.chat(image_message(data_url(png(image)), "Describe it."), GREEDY, use_tqdm=False)
    text = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "<image>\nDescribe it."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = llm.get_tokenizer().encode(text)
    [direct] = llm.generate(
        {"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False
    )
    assert pil.outputs[0].token_ids == url.outputs[0].token_ids == direct.outputs[0].token_ids


def test_placeholders_must_match_the_images_and_their_number_is_limited(llm):
    with pytest.raises(IOProcessorInputError, match="1 image placeholder.* and 2 image"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": [picture(2)] * 2}}, GREEDY)
    with pytest.raises(IOProcessorInputError, match="at most 4 per prompt"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": [picture(2)] * 5}}, GREEDY)
    with pytest.raises(IOProcessorInputError, match="takes images .* only"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"video": [picture(2)]}}, GREEDY)


def server_specs(request: pytest.FixtureRequest) -> tuple[str, ServerSpecs]:
    media = request.getfixturevalue("tmp_path_factory").mktemp("media")
    (media / "cat.png").write_bytes(png(picture(7)))
    flags = (
        "--endpoints",
        "openai",
        "--allowed-local-media-path",
        str(media),
        "--max-images-per-prompt",
        "2",
    )
    return request.getfixturevalue("tiny_llava"), {"llava": ({}, flags)}


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    with module_servers(request) as running:
        yield running["llava"]


def chat(server: Server, messages: list[dict[str, Any]]) -> str:
    response = server.client().chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    return response.choices[0].message.content


def refused(server: Server, messages: list[dict[str, Any]]) -> str:
    with pytest.raises(openai.BadRequestError) as error:
        chat(server, messages)
    body = error.value.body
    assert body["param"] == "messages", body
    return body["message"]


def test_an_image_chat_answers_as_offline(server, llm):
    messages = image_message(data_url(png(picture(3))))
    [offline] = llm.chat(messages, GREEDY, use_tqdm=False)
    assert chat(server, messages) == offline.outputs[0].text
    assert chat(server, [{"role": "user", "content": "Only text."}])


def test_local_files_are_read_from_the_media_directory_only(server):
    args = list(server.proc.args)
    media = args[args.index("--allowed-local-media-path") + 1]
    from_file = chat(server, image_message(f"file://{media}/cat.png"))
    assert from_file == chat(server, image_message(data_url(png(picture(7)))))
    assert "outside the server's media directory" in refused(
        server, image_message(f"file://{media}/../cat.png")
    )


def test_bad_images_get_400_and_the_server_stays_healthy(server):
    good = png(picture(4, 64, 64))
    cases = {
        "truncated PNG": (image_message(data_url(good[: len(good) // 2])), "cannot be decoded"),
        "huge dimensions": (
            image_message(data_url(png(Image.new("L", (6000, 5000))))),
            "6000×5000 pixels",
        ),
        "wrong MIME": (image_message(data_url(good, "text/plain")), "not an image type"),
        "mislabelled": (image_message(data_url(good, "image/gif")), "declared image/gif"),
        "remote URL": (image_message("https://example.com/cat.png"), "no media over the network"),
        "too many": (
            [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": data_url(good)}}] * 3,
                }
            ],
            "at most 2 per prompt",
        ),
    }
    for name, (messages, expected) in cases.items():
        assert expected in refused(server, messages), name
    assert server.get("/health").status_code == 200
    assert chat(server, image_message(data_url(good)))
