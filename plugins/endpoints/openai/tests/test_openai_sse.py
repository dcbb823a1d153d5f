"""Server-Sent Events from the OpenAI endpoint plugin survive line readers that split on the
Unicode line separators (httpx's `aiter_lines`, built on `str.splitlines`)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pagellm_openai", reason="the pagellm-openai package is not installed")

from pagellm_openai.responses import ChatCompletionChunk  # noqa: E402
from pagellm_openai.streams import sse  # noqa: E402


@pytest.mark.parametrize("text", ["a\u2028b", "c\u2029d", "e\x85f", "plain"])
def test_sse_event_is_one_line_whatever_the_generated_text(text):
    chunk = ChatCompletionChunk.model_validate(
        {"id": "chatcmpl-1", "model": "m", "choices": [{"index": 0, "delta": {"content": text}}]}
    )
    for event, read in (
        ({"choices": [{"text": text}]}, lambda d: d["choices"][0]["text"]),
        (chunk, lambda d: d["choices"][0]["delta"]["content"]),
    ):
        frame = sse(event).decode()
        assert frame.startswith("data: ") and frame.endswith("\n\n")
        lines = frame[:-2].splitlines()
        assert len(lines) == 1
        assert read(json.loads(lines[0][len("data: ") :])) == text


TEXTS = ["plain", 'quote " and \\ backslash', "a\u2028b", "e\x85f", "日本語 🙂", "", "\x00"]


@pytest.mark.parametrize("model", ["m", "\x00pagellm-text\x00"])  # the last holds the mark
@pytest.mark.parametrize("object_name", ["text_completion", "chat.completion.chunk"])
def test_text_chunk_from_the_template_is_the_bytes_of_the_whole_chunk(model, object_name):
    from pagellm_openai.streams import ChunkWriter, TextChoice

    def render(index: int, text: str) -> dict:
        return {"index": index, "delta": {"role": None, "content": text}, "logprobs": None}

    writer = ChunkWriter("cmpl-1", object_name, model)
    for index in (0, 3):
        for text in TEXTS:
            assert writer.text(TextChoice(index, text), render) == writer([render(index, text)])
    assert (writer.template(0, render) is None) == (model != "m")
