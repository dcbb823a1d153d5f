"""Server-Sent Events from the OpenAI endpoint plugin survive line readers that split on the
Unicode line separators (httpx's `aiter_lines`, built on `str.splitlines`)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pagellm_openai", reason="the pagellm-openai package is not installed")

from pagellm_openai.protocol import ChatCompletionChunk  # noqa: E402
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
