"""``POST /tokenize`` and ``POST /detokenize``, with vLLM's fields: a text, or messages rendered as
a chat completion renders them, to token ids (and their strings); token ids back to text."""

from __future__ import annotations

from pagellm.entrypoints.http_errors import bad_request
from pagellm_openai.bodies import keys, validated
from pagellm_openai.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from pagellm_openai.responses import DetokenizeResponse, TokenizeResponse
from pagellm_openai.serving import ServingContext


def tokenize(ctx: ServingContext, body: object) -> TokenizeResponse:
    """``body`` is a chat tokenization when it has ``messages``, else a text's."""
    fields = keys(body)
    if {"prompt", "messages"} <= fields:
        raise bad_request("Send either prompt or messages, not both.", param="prompt")
    if "messages" in fields:
        chat = validated(TokenizeChatRequest, body)
        ctx.model_name(chat.model)
        prompt, _ = ctx.chat_prompt(chat)
        tokens, with_strs = prompt.token_ids, chat.return_token_strs
    else:
        text = validated(TokenizeCompletionRequest, body)
        ctx.model_name(text.model)
        encoded = ctx.tokenizer.encode(text.prompt, add_special_tokens=text.add_special_tokens)
        tokens, with_strs = list(encoded), text.return_token_strs
    return TokenizeResponse(
        count=len(tokens),
        max_model_len=ctx.max_model_len,
        tokens=tokens,
        token_strs=ctx.tokenizer.convert_ids_to_tokens(tokens) if with_strs else None,
    )


def detokenize(ctx: ServingContext, request: DetokenizeRequest) -> DetokenizeResponse:
    ctx.model_name(request.model)
    tokenizer = ctx.tokenizer
    bad = [t for t in request.tokens if not 0 <= t < len(tokenizer)]
    if bad:
        raise bad_request(
            f"tokens has ids outside the tokenizer's vocabulary [0, {len(tokenizer)}): {bad[:5]}.",
            param="tokens",
        )
    return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))
