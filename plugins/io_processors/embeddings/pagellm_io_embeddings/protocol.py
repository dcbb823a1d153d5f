"""The OpenAI embeddings API's request body (with vLLM's extensions), and the typed values the
processor's stages pass on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagellm.engine.processor import PromptType
from pagellm.pooling_params import PoolingParams

EncodingFormat = Literal["float", "base64"]


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``. Unknown fields are refused (400 naming them)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    input: Any
    """A string, a list of strings, a list of token ids, or a list of token-id lists (checked by
    `EmbeddingsProcessor.parse_request`, which names the offending item)."""
    model: str | None = None
    encoding_format: EncodingFormat = "float"
    """float: lists of numbers; base64: each vector's float32 little-endian bytes, base64."""
    dimensions: int | None = None
    """Matryoshka output size: refused (400) unless the model declares such dimensions."""
    user: str | None = None
    """OpenAI's end-user id: accepted, not used."""
    truncate_prompt_tokens: int | None = Field(default=None)
    """vLLM's: keep at most this many tokens of each input (-1: max_model_len) instead of
    refusing a longer one."""
    normalize: bool | None = None
    """vLLM's: L2-normalize the vectors (default: as the model's sentence-transformers config
    says)."""


@dataclass
class EmbeddingsInput:
    """A parsed request: one engine prompt per input item, in order, and how to run and answer."""

    prompts: list[PromptType]
    params: PoolingParams
    encoding_format: EncodingFormat
    model: str | None


@dataclass
class EmbeddingsResult:
    """The vectors in input order, with what the response reports."""

    vectors: list[list[float]]
    prompt_tokens: int
    encoding_format: EncodingFormat
    model: str | None
