"""Loading the tokenizer: a HF tokenizer directory, or the one embedded in a GGUF file."""

from __future__ import annotations

from typing import Any

from pagellm.model_loader.source import from_pretrained_trusting, resolve_model_source


def get_tokenizer(tokenizer: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer at ``tokenizer``; its own code (``auto_map``) runs only when trusted."""
    from transformers import AutoTokenizer

    source = resolve_model_source(tokenizer, field="tokenizer")
    return from_pretrained_trusting(
        AutoTokenizer, source.hf_directory(), trust_remote_code, "The tokenizer"
    )
