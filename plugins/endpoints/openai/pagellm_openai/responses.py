"""Response shapes of the OpenAI-compatible API (pydantic): completions, chat completions and
their stream chunks, models, tokenization, server load."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    """With ``--enable-prompt-tokens-details``: the prompt tokens found in the prefix cache."""


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob``: one token of a prompt position's ``prompt_logprobs`` entry."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token: None for the first, then token id -> its logprob (the prompt's token first).
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    """A completion, or (``usage`` None until the last) one chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: str = "assistant"
    """``assistant``, or the last message's role when no new turn was opened."""
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class ModelPermission(BaseModel):
    """What a client may do with a model, as vLLM (and OpenAI's older API) describe it."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=_now)
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagellm"
    root: str
    """The model the server loaded (its directory or GGUF file)."""
    parent: str | None = None
    """The base model of an adapter; None for a base model."""
    max_model_len: int
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None
    """The tokenizer's string for each token (``return_token_strs``)."""


class DetokenizeResponse(BaseModel):
    prompt: str


class ServerLoad(BaseModel):
    server_load: int
    """Generation requests in flight (completions and chat, streamed ones until their end)."""
