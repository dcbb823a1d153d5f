"""Loading the tokenizer: a HF tokenizer directory, or the one embedded in a GGUF file."""

from __future__ import annotations

from typing import Any

from pagellm.model_loader.source import resolve_model_source


def get_tokenizer(tokenizer: str) -> Any:
    from transformers import AutoTokenizer

    source = resolve_model_source(tokenizer, field="tokenizer")
    return AutoTokenizer.from_pretrained(source.hf_directory())
