"""Request and response shapes of the OpenAI-compatible API (pydantic).

Requests are validated strictly (a string where a number belongs is an error, not a conversion);
fields the API defines but pagellm does not use are ignored, as OpenAI clients send some of them
by default. The extensions after the OpenAI fields carry vLLM's names.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from pagellm.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS


def _no_lone_surrogates(text: str) -> str:
    """JSON can carry lone UTF-16 surrogates (``"\\ud800"``), which no text encodes: refused."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"contains a lone surrogate (U+{ord(text[exc.start]):04X}), which is not text"
            ) from None
    return text


def _check_strings(value: Any, where: str) -> None:
    if isinstance(value, str):
        try:
            _no_lone_surrogates(value)
        except ValueError as exc:
            raise ValueError(f"{where} {exc}") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key, where)
            _check_strings(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_strings(item, f"{where}[{i}]")


Text = Annotated[str, AfterValidator(_no_lone_surrogates)]
# Integers the engine's wire carries (msgpack int64).
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: with ``include_usage``, every chunk carries the usage of its choice so far."""


class SamplingRequest(_Request):
    """What completions and chat completions share."""

    model: Text | None = None
    n: int = Field(1, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    stop: Text | list[Text] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[Text, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # Extensions (vLLM's names).
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Int64 = 0
    """Lower runs first when the server schedules by priority (``--scheduling-policy priority``)."""
    cache_salt: Text | None = None
    """Requests of different salts share no prefix-cache blocks."""
    request_id: Text | None = None
    """The response's id (after ``cmpl-``/``chatcmpl-``) unless an ``X-Request-Id`` header says."""
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[Text] | None = None
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    """Logprobs of each prompt token and the top ``prompt_logprobs`` (0 to MAX_LOGPROBS)."""
    return_token_ids: bool = False
    """``prompt_token_ids`` and each choice's ``token_ids`` in the response (and chunks)."""
    return_tokens_as_token_ids: bool | None = None
    """Logprobs' tokens as ``token_id:N`` (None: the server's ``--return-tokens-as-token-ids``)."""
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    """Keep only this many prompt tokens (-1: as many as the context leaves room for)."""
    truncation_side: Literal["left", "right"] | None = None
    """Which end truncation cuts: "left" (the default) keeps the last tokens, "right" the first."""


class CompletionRequest(SamplingRequest):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Text | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """One message; fields beyond role and content (name, ...) are passed to the chat template."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None

    @model_validator(mode="after")
    def _extra_fields_are_text(self) -> ChatMessage:
        for key, value in (self.model_extra or {}).items():
            _check_strings(key, "a field name")
            _check_strings(value, key)
        return self


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Extension: False to continue the last message instead of starting the assistant's turn.
    add_generation_prompt: bool = True


class TokenizeRequest(_Request):
    """Either ``prompt`` (text) or ``messages`` (rendered through the chat template)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: Text | None = None
    tokens: list[TokenId]


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
    role: Literal["assistant"] = "assistant"
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
    role: Literal["assistant"] | None = None
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


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagellm"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
