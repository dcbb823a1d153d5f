"""Loading the tokenizer: a HF tokenizer directory, or the one embedded in a GGUF file."""

from __future__ import annotations

from typing import Any

from pagellm.model_loader.source import REMOTE_CODE_HINT, resolve_model_source


def get_tokenizer(tokenizer: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer at ``tokenizer``; its own code (``auto_map``) runs only when trusted."""
    from transformers import AutoTokenizer

    source = resolve_model_source(tokenizer, field="tokenizer")
    try:
        return AutoTokenizer.from_pretrained(
            source.hf_directory(), trust_remote_code=trust_remote_code
        )
    except ValueError as exc:
        if trust_remote_code or "trust_remote_code" not in str(exc):
            raise
        raise ValueError(
            f"The tokenizer at {source.hf_directory()} brings its own code (auto_map), which runs only "
            f"when trusted: {REMOTE_CODE_HINT}."
        ) from None
