"""Request shapes of the OpenAI-compatible API (pydantic; the responses are in `responses`).

Requests are validated strictly (a string where a number belongs is an error, not a conversion)
and an unknown field is an error too: what each field of OpenAI's API or vLLM's extensions does
here (implemented, accepted as a no-op, refused) is declared, no-ops and refusals in
`field_policy`. The extensions after the OpenAI fields carry vLLM's names.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from pagellm.sampling_params import INT64_MAX
from pagellm_openai.field_policy import (
    AcceptedNoOps,
    RefusedCompletionFields,
    RefusedFields,
    RefusedStreamOptions,
)
from pagellm_openai.text_types import Int64, Text, TokenId, check_strings


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(RefusedStreamOptions, _Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: with ``include_usage``, every chunk carries the usage of its choice so far."""


# OpenAI's fields that take null for their default (the official clients send null for None).
_NULL_IS_DEFAULT = frozenset({"n", "stream", "echo", "logprobs"})


class SamplingRequest(AcceptedNoOps, RefusedFields, _Request):
    """What completions and chat completions share."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in _NULL_IS_DEFAULT}
        return data

    model: Text | None = None
    n: int = Field(1, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    stop: Text | list[Text] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[Text, Annotated[float, Field(allow_inf_nan=False)]] | None = None
    """Token id (a decimal string) → bias, clamped to [-100, 100]."""
    stream: bool = False
    stream_options: StreamOptions | None = None
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
    """Logprobs of each prompt token and the top ``prompt_logprobs`` (up to the server's
    ``--max-logprobs``; -1: the whole vocabulary)."""
    return_token_ids: bool = False
    """``prompt_token_ids`` and each choice's ``token_ids`` in the response (and chunks)."""
    return_tokens_as_token_ids: bool | None = None
    """Logprobs' tokens as ``token_id:N`` (None: the server's ``--return-tokens-as-token-ids``)."""
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    """Keep only this many prompt tokens (-1: as many as the context leaves room for)."""
    truncation_side: Literal["left", "right"] | None = None
    """Which end truncation cuts: "left" (the default) keeps the last tokens, "right" the first."""


class CompletionRequest(RefusedCompletionFields, SamplingRequest):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=-1)
    """Top logprobs of each token (up to the server's ``--max-logprobs``; -1: the whole vocabulary)."""
    add_special_tokens: bool = True
    """Add the tokenizer's special tokens (BOS, ...) to a text prompt (vLLM's extension)."""


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class ImageURL(_Request):
    url: Text
    """A ``data:`` URL (base64), or a ``file:`` URL under the server's media directory."""
    detail: Literal["auto", "low", "high"] | None = None
    """Accepted; the model's image processor decides the resolution."""


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]
PART_TYPES = ("text", "image_url")


class ChatMessage(BaseModel):
    """One message. Any role is accepted (the chat template decides which it knows); fields
    beyond role and content (``name``, ...) are passed to the chat template. ``image_url``
    parts are taken here and refused by the route unless the model's IO processor takes them."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: Text
    content: Text | list[ContentPart] | None = None
    name: Text | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts_only(cls, content: Any) -> Any:
        """An audio or file part is refused naming its type (the union's own errors would
        only say that the part is none of the known ones)."""
        for i, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in PART_TYPES:
                raise ValueError(
                    f"content[{i}] is a part of type {kind!r}, which is not supported: this "
                    "server takes text and image_url parts only"
                )
        return content

    @model_validator(mode="after")
    def _extra_fields_are_text(self) -> ChatMessage:
        for key, value in (self.model_extra or {}).items():
            check_strings(key, "a field name")
            check_strings(value, key)
        return self

    def text(self) -> str:
        """The content's text as one string: text parts joined by newlines, none as empty."""
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content if isinstance(p, TextPart))
        return self.content or ""

    def image_urls(self) -> list[str]:
        """The URLs of its ``image_url`` parts, in order."""
        parts = self.content if isinstance(self.content, list) else []
        return [p.image_url.url for p in parts if isinstance(p, ImagePart)]


def _checked_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    check_strings(kwargs, "chat_template_kwargs")
    return kwargs


class ChatTemplateRequest(_Request):
    """What renders messages through a chat template: chat completions and chat tokenization.
    Which template renders them, and the checks these fields pass, are in `chat_template`."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    """End the prompt with the header of a new turn (default: true, unless
    continue_final_message is set)."""
    continue_final_message: bool = False
    """Leave the last message open, for the model to continue it (a prefill)."""
    add_special_tokens: bool = False
    """Add the tokenizer's special tokens (BOS, ...) to the rendered text, on top of the
    template's own."""
    chat_template: Text | None = Field(None, min_length=1)
    """A Jinja template for this request (needs --trust-request-chat-template)."""
    chat_template_kwargs: Annotated[dict[Text, Any] | None, AfterValidator(_checked_kwargs)] = None
    """Variables the template sees."""
    documents: list[dict[Text, Text]] | None = None
    """Documents for templates that take them (retrieval-augmented generation)."""

    def opens_a_new_turn(self) -> bool:
        """add_generation_prompt, whose default gives way to continue_final_message."""
        if "add_generation_prompt" in self.model_fields_set:
            return self.add_generation_prompt
        return not self.continue_final_message


class ChatCompletionRequest(SamplingRequest, ChatTemplateRequest):
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    """OpenAI's current name of ``max_tokens``; when both are given, this one counts."""
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=-1)
    """Top logprobs of each token (up to the server's ``--max-logprobs``; -1: the whole vocabulary)."""
    echo: bool = False
    """Start each answer with the last message's content when the answer has its role."""


class TokenizeCompletionRequest(_Request):
    """``/tokenize`` of a text."""

    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateRequest):
    """``/tokenize`` of messages, rendered as a chat completion would render them."""

    model: Text | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: Text | None = None
    tokens: list[TokenId]
